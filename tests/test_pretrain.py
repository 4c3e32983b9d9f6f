"""MLM pretraining (classify.pretrain, classify.mlm) and fine-tuning from it (classify.train --init-from)."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from conftest import TINY_MODEL_ARGS, synthetic_reviews
from safetensors.torch import load_file

import classify.engine.loop as loop
import classify.train as train_module
from classify.engine.files import read_jsonl, write_json
from classify.engine.optim import build_optimizer, set_lr
from classify.engine.runfolder import CONFIG, FORMAT_VERSION
from classify.errors import ClassifyError, run_cli
from classify.finetune import layer_lr_scale, load_pretrained_encoder
from classify.mlm import IGNORE, MaskedLM, Masker
from classify.models import Classifier, ClassifierConfig
from classify.pretrain import main as pretrain_main
from classify.pretrain import pretraining_texts
from classify.text.data import normalize
from classify.text.tokenize import SPECIAL_TOKENS, train_tokenizer

TINY_PRETRAIN_ARGS = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--max-len", "64",
                      "--vocab-size", "200", "--max-tokens", "512", "--val-size", "80", "--mlm-val-size", "100",
                      "--lr", "3e-3", "--warmup", "10", "--precision", "fp32", "--quiet", "--threads", "1"]


@pytest.fixture(scope="module", autouse=True)
def restore_threads():
    """--threads 1 (tiny models run fastest on one thread, above all on a busy machine) sets a
    process-wide torch setting: give the other test modules theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory, unlabelled_data) -> Path:
    run = tmp_path_factory.mktemp("runs") / "pretrain"
    assert pretrain_main(["--data", str(unlabelled_data), "--output", str(run), "--max-steps", "90",
                          "--epochs", "10", "--eval-every", "30", *TINY_PRETRAIN_ARGS]) == 0
    return run


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([t for t, _ in synthetic_reviews(200)], 200)


# ------------------------------------------------------------------------ masking
def test_masking_rates_and_split(tokenizer):
    masker = Masker(tokenizer)
    vocab = tokenizer.get_vocab_size()
    tokens = torch.randint(0, vocab, (400, 300))  # every id, specials included
    tokens[:, 240:] = 0  # padding at the end of every row
    torch.manual_seed(0)
    inputs, targets = masker(tokens)
    special = tokens < len(SPECIAL_TOKENS)
    target = targets != IGNORE
    assert not (target & special).any()  # specials (padding included) are never targets
    assert not target[:, 240:].any()
    assert torch.equal(targets[target], tokens[target])  # a target is the original token
    assert torch.equal(inputs[~target], tokens[~target])  # everything else is left alone
    assert abs(target.sum().item() / (~special).sum().item() - 0.15) < 0.005
    masked = inputs[target] == masker.mask_id
    changed = ~masked & (inputs[target] != tokens[target])
    n = target.sum().item()
    assert abs(masked.sum().item() / n - 0.8) < 0.015
    # A random replacement can hit the original token (1 in ~vocab): "kept" is a little over 10%.
    assert abs(changed.sum().item() / n - 0.1) < 0.015
    assert abs((n - masked.sum().item() - changed.sum().item()) / n - 0.1) < 0.015
    replacements = inputs[target][changed]
    assert (replacements >= len(SPECIAL_TOKENS)).all()  # random tokens are ordinary words


def test_masking_is_dynamic_but_reproducible_with_a_generator(tokenizer):
    masker = Masker(tokenizer)
    tokens = torch.randint(len(SPECIAL_TOKENS), tokenizer.get_vocab_size(), (8, 100))
    first, second = masker(tokens)[1], masker(tokens)[1]
    assert not torch.equal(first, second)  # fresh positions every call
    fixed = [masker(tokens, torch.Generator().manual_seed(3))[1] for _ in range(2)]
    assert torch.equal(*fixed)


def test_mlm_model_shares_classifier_parameter_names():
    config = ClassifierConfig(vocab_size=50, d_model=16, num_heads=2, num_layers=2, d_ff=32, max_len=20)
    mlm_names = {n for n in MaskedLM(config).state_dict() if not n.startswith("mlm_head.")}
    classifier_names = {n for n in Classifier(config).state_dict() if not n.startswith("head.")}
    assert mlm_names == classifier_names
    model = MaskedLM(config)
    tokens = torch.randint(5, 50, (3, 10))
    targets = torch.full_like(tokens, IGNORE)
    targets[0, 2], targets[2, 7] = 11, 12
    logits, labels = model(tokens, targets)
    assert logits.shape == (2, 50) and labels.tolist() == [11, 12]  # the vocab projection runs at targets only


# ---------------------------------------------------------------------- pretraining
def test_pretraining_learns_and_writes_a_run_folder(pretrained_run):
    for name in ("config.json", "tokenizer.json", "model.safetensors", "metrics.jsonl", "last/state.json"):
        assert (pretrained_run / name).exists(), name
    config = json.loads((pretrained_run / "config.json").read_text())
    assert config["kind"] == "pretrain" and config["model"]["d_model"] == 32
    records = read_jsonl(pretrained_run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 30, 60, 90]
    assert records[-1]["val_loss"] < records[0]["val_loss"] - 0.3  # MLM loss falls
    assert records[-1]["val_accuracy"] > records[0]["val_accuracy"]
    assert not list(pretrained_run.rglob("*.tmp"))


def test_pretraining_text_excludes_test_and_classifier_validation(unlabelled_data, monkeypatch):
    import classify.text.data as data_module
    from classify.text.data import training_split

    splits = []
    real = data_module.load_split

    def recording(source, split, *args, **kwargs):
        splits.append(split)
        return real(source, split, *args, **kwargs)

    monkeypatch.setattr(data_module, "load_split", recording)  # every split pretraining reads goes through it
    train, val, _ = pretraining_texts(str(unlabelled_data), val_size=80, mlm_val_size=100, seed=0)
    assert "test" not in splits and {"train", "unsupervised"} <= set(splits)
    _, classifier_val = training_split(str(unlabelled_data), 80, 0)
    assert not {normalize(t) for t in classifier_val.texts} & set(train)
    assert len(val) == 100 and not set(val) & set(train)
    assert len(train) == (600 - 100) + (400 - 80)  # unsupervised less MLM validation + train less classifier validation


def test_pretraining_without_unsupervised_split(parquet_data, tmp_path):
    assert pretrain_main(["--data", str(parquet_data), "--output", str(tmp_path / "run"), "--max-steps", "5",
                          *TINY_PRETRAIN_ARGS]) == 0


def test_pretraining_resumes(unlabelled_data, tmp_path):
    run = tmp_path / "run"
    args = ["--data", str(unlabelled_data), "--output", str(run), "--eval-every", "6", "--save-every", "3",
            "--epochs", "5", *TINY_PRETRAIN_ARGS]
    assert pretrain_main([*args, "--max-steps", "8"]) == 0
    assert pretrain_main([*args, "--max-steps", "12"]) == 0
    state = json.loads((run / "last" / "state.json").read_text())
    assert state["step"] == 12
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [0, 6, 8, 12]
    with pytest.raises(ClassifyError, match="differs in: mask_prob"):
        pretrain_main([*args, "--mask-prob", "0.2"])


# ----------------------------------------------------------------------- fine-tuning
def test_init_from_loads_exactly_the_pretrained_encoder(pretrained_run, unlabelled_data, tmp_path, monkeypatch):
    pretrained = load_file(str(pretrained_run / "model.safetensors"))
    seen = {}
    real_step = loop.optimizer_step

    def capture(loss, model, *args, **kwargs):  # the weights as fine-tuning starts, before any update
        seen.setdefault("state", {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        return real_step(loss, model, *args, **kwargs)

    monkeypatch.setattr(loop, "optimizer_step", capture)
    out = tmp_path / "finetune"
    assert train_module.main(["--init-from", str(pretrained_run), "--data", str(unlabelled_data), "--output",
                              str(out), "--val-size", "80", "--max-steps", "3", "--quiet", "--no-test"]) == 0
    start = seen["state"]
    encoder = [k for k in start if k.startswith(("embed.", "encoder."))]
    assert encoder and all(torch.equal(start[k], pretrained[k]) for k in encoder)
    # A fresh head, the default n-gram branch fitted on the labelled reviews and the vector that marks its negation
    # scope for the transformer (zero at the start): not pretrained.
    assert set(start) - set(encoder) == {"head.weight", "head.bias", "ngram.weight", "ngram.bias", "mix",
                                         "scope_vector"}
    assert not start["scope_vector"].any()
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["init_from"] == str(pretrained_run) and config["train"]["lr"] == 3e-4
    assert config["train"]["word_vectors"] is False  # the recipe's default start; the embedding is pretrained
    assert config["model"]["d_model"] == 32 and config["model"]["max_len"] == 64
    assert (out / "tokenizer.json").read_text() == (pretrained_run / "tokenizer.json").read_text()
    # Resuming (same command, more steps) continues from last/ rather than reloading the encoder.
    assert train_module.main(["--init-from", str(pretrained_run), "--data", str(unlabelled_data), "--output",
                              str(out), "--val-size", "80", "--max-steps", "5", "--quiet", "--no-test"]) == 0
    assert json.loads((out / "last" / "state.json").read_text())["step"] == 5


def test_load_pretrained_encoder_refuses_a_different_model(pretrained_run):
    config = ClassifierConfig.from_dict(json.loads((pretrained_run / "config.json").read_text())["model"])
    config.d_ff = 128
    with pytest.raises(ClassifyError, match="d_ff 128 vs pretrained 64"):
        load_pretrained_encoder(Classifier(config), pretrained_run)


@pytest.mark.parametrize("flags, message", [
    (["--d-model", "64"], "--d-model 64 vs pretrained --d-model 32"),
    (["--post-ln"], "--no-norm-first vs pretrained --norm-first"),  # --post-ln: the old spelling
    (["--tokenizer", "bpe"], "--tokenizer bpe vs pretrained --tokenizer word"),
])
def test_init_from_refuses_conflicting_flags(pretrained_run, unlabelled_data, tmp_path, capsys, flags, message):
    argv = ["--init-from", str(pretrained_run), "--data", str(unlabelled_data), "--output", str(tmp_path / "x"),
            *flags]
    assert run_cli(train_module.main, argv, prog="classify.train") == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_init_from_refuses_runs_that_are_not_pretraining(tmp_path):
    classifier_run = tmp_path / "classifier"
    write_json(classifier_run / CONFIG, {"format_version": FORMAT_VERSION, "kind": "classifier", "model": {}})
    with pytest.raises(ClassifyError, match="not a 'pretrain' run"):
        train_module.main(["--init-from", str(classifier_run), "--output", str(tmp_path / "x"), *TINY_MODEL_ARGS])
    with pytest.raises(ClassifyError, match="--init-from: run folder not found"):
        train_module.main(["--init-from", str(tmp_path / "nothing"), "--output", str(tmp_path / "x")])


def test_the_optimizer_is_fused_adamw_with_foreach_adamws_updates():
    # The fused kernel on a CPU too (8x faster than foreach there): the same updates, and each kind loads the
    # other's state, so a run resumes across the change. (A module whose every gradient carries signal: the
    # attention's key bias gets a gradient of rounding noise only, which Adam's normalisation makes a coin toss.)
    torch.manual_seed(0)
    models = [nn.ModuleDict({"embed": nn.Embedding(50, 8), "head": nn.Linear(8, 3)}) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    start = models[0]["head"].weight.detach().clone()
    fused = build_optimizer(models[0], 1e-2, 0.1)
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]}
              for g in build_optimizer(models[1], 1e-2, 0.1).param_groups]
    foreach = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.98), foreach=True)
    assert fused.defaults["fused"] and not foreach.defaults["fused"]
    tokens = torch.randint(0, 50, (4, 12))
    for _ in range(5):
        for model, optimizer in zip(models, (fused, foreach)):
            model["head"](model["embed"](tokens)).logsumexp(-1).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(models[0]["head"].weight, start)
    foreach.load_state_dict(fused.state_dict())
    fused.load_state_dict(foreach.state_dict())


def test_layer_decay_scales_group_learning_rates():
    model = Classifier(vocab_size=50, d_model=16, num_heads=2, num_layers=2, d_ff=32, max_len=20)
    optimizer = build_optimizer(model, 1e-3, 0.1, lr_scale=layer_lr_scale(2, 0.5))
    set_lr(optimizer, 1e-3)
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    assert lr_of[id(params["head.weight"])] == pytest.approx(1e-3)
    assert lr_of[id(params["encoder.layers.1.feed_forward.linear1.weight"])] == pytest.approx(5e-4)
    assert lr_of[id(params["encoder.layers.0.feed_forward.linear1.weight"])] == pytest.approx(2.5e-4)
    assert lr_of[id(params["embed.tokens.weight"])] == pytest.approx(1.25e-4)
    assert optimizer.param_groups[0]["lr_scale"] == 1.0  # group 0 (the logged lr) is the unscaled one
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(params)
