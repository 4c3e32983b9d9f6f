"""One name per setting (classify.engine.config): flags generated from the config dataclasses, old
spellings as aliases, checks with the dataclass, runtime flags."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
import torch

from classify import pretrain, train
from classify.engine.config import InferenceConfig, from_args, runtime
from classify.errors import ClassifyError, run_cli
from classify.models import ClassifierConfig, TransformerConfig
from classify.seq2seq import cli as seq2seq_cli
from classify.seq2seq.task import Seq2SeqTrainConfig
from classify.serve.__main__ import build_parser as serve_parser
from classify.serve.limits import Limits
from classify.train_config import TrainConfig

# Flags that say how to run a command, not what the run is (config.json does not store them); the server's say
# what to serve and where.
INVOCATION = {"help", "output", "resume", "overwrite", "quiet", "dist_timeout", "no_test", "layers",
              "model", "host", "port", "workers", "log_level", "access_log", "api_key"}


def seq2seq_train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    seq2seq_cli.add_train_parser(parser.add_subparsers(dest="command"))
    return parser._subparsers._group_actions[0].choices["train"]


PARSERS = [(train.build_parser, TrainConfig, ClassifierConfig),
           (pretrain.build_parser, pretrain.PretrainConfig, ClassifierConfig),
           (seq2seq_train_parser, Seq2SeqTrainConfig, TransformerConfig),
           (serve_parser, Limits, InferenceConfig)]   # the server has no model config: its runtime flags instead


@pytest.mark.parametrize("make_parser, config, model", PARSERS, ids=["train", "pretrain", "seq2seq", "serve"])
def test_every_flag_is_a_field_named_by_the_rule(make_parser, config, model):
    every = [a for a in make_parser()._actions if a.help != argparse.SUPPRESS]
    for action in every:   # invocation flags too: one name, --num-heads for num_heads
        assert "--" + action.dest.replace("_", "-") in action.option_strings, action.option_strings
    actions = [a for a in make_parser()._actions if a.dest not in INVOCATION]
    known = {f.name for f in fields(config)} | {f.name for f in fields(model)}
    for action in actions:
        assert action.dest in known, action.dest
        assert "--" + action.dest.replace("_", "-") in action.option_strings or action.help == argparse.SUPPRESS
    defaults = {a.dest: a.default for a in actions}
    for field in fields(config):  # every stored run setting has its flag, defaulting to the config's default
        assert field.name in defaults, f"{config.__name__}.{field.name} has no flag"
        if field.name != "data":  # --data defaults to $CLASSIFY_DATA or the hub id, or is required
            assert defaults[field.name] == field.default, field.name


def test_stored_config_round_trips_the_parsed_flags():
    args = train.build_parser().parse_args(["--output", "x", "--lr", "5e-4", "--time-budget", "30", "--threads", "1"])
    model, config = train.configs_from_args(args)
    assert (config.lr, config.time_budget, config.threads, config.epochs) == (5e-4, 30.0, 1, 3)
    assert "threads" not in TrainConfig.IDENTITY  # how many threads a run used may change on resume
    assert model.d_model == args.d_model == 128 and model.num_classes == 2


def test_a_training_cut_at_or_above_max_len_cuts_nothing_and_is_recorded_as_no_cut():
    parse = train.build_parser().parse_args
    cuts = [train.configs_from_args(parse(["--output", "x", *flags]))[1].train_max_len
            for flags in ((), ("--train-max-len", "512"), ("--train-max-len", "600"), ("--max-len", "128"))]
    assert cuts == [256, None, None, None]   # None: as runs from before the flag recorded (test_loop resumes one)


def test_the_recipe_hands_the_branch_negation_scope_to_the_transformer_where_there_is_one():
    def scope(*flags: str) -> tuple[bool, float]:
        model, _ = train.configs_from_args(train.build_parser().parse_args(["--output", "x", *flags]))
        return model.scope_embedding, model.scope_dropout

    assert scope() == (True, 0.25)                                         # the recipe
    assert scope("--ngram-orders", "0") == (False, 0.0)                    # no branch: nothing to read
    assert scope("--ngram-negation", "0", "--ngram-ellipsis", "0") == (False, 0.0)   # a branch that marks nothing
    assert scope("--ngram-negation", "0") == (True, 0.25)                  # the ellipsis rule still marks
    assert scope("--no-scope-embedding") == (False, 0.0)
    assert scope("--scope-dropout", "0.5") == (True, 0.5)
    with pytest.raises(ClassifyError, match="scope_embedding marks the words"):
        scope("--ngram-orders", "0", "--scope-embedding")                  # asked for, so not dropped silently


def test_old_spellings_still_work():
    parse = train.build_parser().parse_args
    old = parse(["--output", "x", "--heads", "2", "--layers", "3", "--post-ln", "--no-padding-mask"])
    new = parse(["--output", "x", "--num-heads", "2", "--num-layers", "3", "--no-norm-first", "--no-mask-padding"])
    assert train.configs_from_args(old) == train.configs_from_args(new)
    model, _ = train.configs_from_args(old)
    assert (model.num_heads, model.num_layers, model.norm_first, model.mask_padding) == (2, 3, False, False)
    seq2seq = seq2seq_train_parser().parse_args(["--data", ".", "--output", "x", "--layers", "2", "--no-tie-embeddings"])
    model, _ = seq2seq_cli.configs_from_args(seq2seq)
    assert (model.num_encoder_layers, model.num_decoder_layers, model.tie_embeddings) == (2, 2, False)
    assert "--heads: kept for one release" in train.build_parser().format_help().replace("\n", " ").replace("  ", " ")


@pytest.mark.parametrize("flags, message", [
    (["--time-budget", "-1"], "--time-budget must not be negative"),
    (["--warmup", "-5"], "--warmup must not be negative"),
    (["--lr", "0"], "--lr must be positive"),
    (["--num-layers", "0"], "num_layers must be positive"),
    (["--max-steps", "0"], "--max-steps must be positive"),
    (["--d-model", "30", "--num-heads", "4"], "d_model (30) must be a multiple of num_heads (4)"),
    (["--dropout", "1"], "dropout must be in [0, 1)"),
])
@pytest.mark.parametrize("module", [train, pretrain], ids=["train", "pretrain"])
def test_bad_settings_are_one_line_errors(module, flags, message, tmp_path, capsys):
    assert run_cli(module.main, ["--output", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_config_default_names_a_missing_field():
    assert TrainConfig.default("lr") == 1e-3
    with pytest.raises(KeyError, match="no field 'nope'"):
        TrainConfig.default("nope")


def test_time_budget_zero_is_allowed():
    args = train.build_parser().parse_args(["--output", "x", "--time-budget", "0"])
    model, config = train.configs_from_args(args)
    assert from_args(TrainConfig, args).time_budget == config.time_budget == 0


def test_runtime_applies_threads_and_rejects_impossible_devices():
    before = torch.get_num_threads()
    try:
        device, _ = runtime(argparse.Namespace(threads=1, device="cpu", precision="fp32"))
        assert device.type == "cpu" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ClassifyError, match="--threads must be at least 1"):
        runtime(argparse.Namespace(threads=0, device="cpu", precision="fp32"))
    with pytest.raises(ClassifyError, match="fp16"):
        runtime(argparse.Namespace(threads=None, device="cpu", precision="fp16"))
