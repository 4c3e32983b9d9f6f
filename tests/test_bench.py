"""The speed benchmark at toy sizes: keeps experiments.bench runnable. Checks structure, never speed."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_core import copy_decoder_layer, copy_encoder_layer

from classify.models import Transformer
from experiments import bench
from experiments.bench_seq2seq import QUICK_SEQ2SEQ, TorchSeq2Seq, transformer_config

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")

TINY = dataclasses.replace(
    bench.QUICK, train_sample=80, test_sample=24, repeats=2, lengths=(16, 32), big_lengths=(),
    attn_dropout_lengths=(32,), epoch_steps=2, epoch_fp32_bucketed=True, infer_precisions=("fp32", "bf16"),
    infer_batch_size=8, latency_reviews=3, load_repeats=1, scaling_lengths=(8, 16), scaling_batches=(2,),
    scaling_batch=2, scaling_length=16, batch_size=8, vocab_size=300, matmul_size=64,
    model={"d_model": 16, "num_heads": 2, "num_layers": 1, "d_ff": 32, "dropout": 0.1},
    seq2seq=dataclasses.replace(QUICK_SEQ2SEQ, d_model=16, num_heads=2, num_layers=1, d_ff=32, vocab_size=100,
                                max_len=64, max_tokens=128, pairs=40, generate_batch=2, source_len=8,
                                generate_tokens=4))


@pytest.fixture(scope="module")
def results(parquet_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_tiny"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the CLI's default: tiny ops on a busy machine crawl with more threads
    try:
        return bench.run(str(parquet_data), TINY, torch.device("cpu"), log=lambda message: None), out
    finally:
        torch.set_num_threads(threads)


def test_every_section_reports_positive_numbers(results):
    res, _ = results
    assert set(bench.SECTIONS) <= set(res)
    for entry in res["training"]:
        assert entry["ratios"] and all(v > 0 for v in entry["ratios"].values())
        for arm in entry["arms"].values():
            assert arm["rate_median"] > 0 and arm["rounds"] == TINY.repeats and arm["mfu"] > 0
    assert {"ours/torch fp32", "no-attn-dropout/ours fp32", "our dropout/F.dropout fp32"} <= set(
        res["training"][-1]["ratios"])
    assert all(p["epoch_minutes"] > 0 for p in res["epoch"]["pipelines"].values())
    assert set(res["epoch"]["speedup"]) == {"padded512_fp32", "bucketed_fp32"} or "bf16" not in res["peak_matmul"]
    assert all(v > 0 for v in res["inference"]["ratios"].values())
    assert res["latency"]["predict_ms_p95"] >= res["latency"]["predict_ms_p50"] > 0
    points = [(p["batch"], p["length"], p["attention_dropout"]) for p in res["scaling"]["points"]]
    assert points == [(2, 8, True), (2, 16, True), (2, 16, False)]
    assert all(p["step_s"] > 0 and (p["peak_mib"] is None or p["peak_mib"] >= 0) for p in res["scaling"]["points"])
    assert all(v > 0 for v in res["seq2seq"]["training"]["ratios"].values())
    assert all(v > 0 for v in res["seq2seq"]["generation"]["ratios"].values())


def test_the_torch_dropout_arm_is_our_model_with_pytorch_dropout():
    config = bench.classifier_config(TINY, 300)
    model = bench.with_torch_dropout(bench.Classifier(config))
    dropouts = [m for m in model.modules() if isinstance(m, (bench.Dropout, torch.nn.Dropout))]
    assert dropouts and all(type(m) is torch.nn.Dropout and m.p == 0.1 for m in dropouts)
    torch.manual_seed(0)
    ours = bench.Classifier(config).eval()
    torch.manual_seed(0)
    theirs = bench.with_torch_dropout(bench.Classifier(config)).eval()
    tokens = torch.randint(1, 300, (2, 9))
    torch.testing.assert_close(ours(tokens), theirs(tokens), rtol=0, atol=0)   # the same model, in eval mode


def test_torch_classifier_computes_the_same_function(results):
    res, _ = results
    assert res["equivalence"]["max_abs_logit_diff_fp32"] < 1e-4


def test_torch_seq2seq_computes_the_same_function():
    torch.manual_seed(0)
    config = transformer_config(dataclasses.replace(TINY.seq2seq, dropout=0.0))
    ours, theirs = Transformer(config).eval(), TorchSeq2Seq(config).eval()
    for a, b in zip(ours.encoder.layers, theirs.transformer.encoder.layers):
        copy_encoder_layer(a, b)
    for a, b in zip(ours.decoder.layers, theirs.transformer.decoder.layers):
        copy_decoder_layer(a, b)
    ours.encoder.norm.load_state_dict(theirs.transformer.encoder.norm.state_dict())
    ours.decoder.norm.load_state_dict(theirs.transformer.decoder.norm.state_dict())
    for name in ("src_embed", "tgt_embed", "generator"):
        getattr(theirs, name).load_state_dict(getattr(ours, name).state_dict())
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0]])
    tgt = torch.tensor([[2, 11, 12, 13], [2, 14, 0, 0]])
    with torch.no_grad():
        real = (tgt != 0).unsqueeze(-1)  # logits at padded target positions are never scored
        torch.testing.assert_close(ours(src, tgt) * real, theirs(src, tgt) * real, rtol=1e-5, atol=1e-5)


def test_report_is_json_and_markdown(results):
    res, out = results
    report = bench.to_markdown(res, "python -m experiments.bench --test")
    assert "## Training throughput" in report and "## Encoder-decoder" in report
    json.dumps(res)  # everything is JSON-serialisable
    assert bench.headline(res)


def test_cli_help_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_inference_without_bf16_falls_back_to_fp32_and_says_so(parquet_data, monkeypatch):
    """--quick times inference in bf16 only; a CPU without it got an empty table."""
    monkeypatch.setattr(bench, "bf16_supported", lambda device: False)
    sizes = dataclasses.replace(TINY, infer_precisions=("bf16",))
    results = bench.run(str(parquet_data), sizes, torch.device("cpu"), sections=["inference"], log=lambda m: None)
    inference = results["inference"]
    assert inference["precisions"] == ["fp32"] and inference["skipped_precisions"] == ["bf16"]
    assert inference["arms"] and all(a["rate_median"] > 0 for a in inference["arms"].values())
    assert "precision fp32 (bf16 not supported here)" in bench.to_markdown(results, "python -m experiments.bench")


def test_results_stay_untracked_unless_recorded():
    from experiments import RECORDED, SCRATCH, results_folder

    parser = bench.build_parser()
    assert results_folder(parser.parse_args([])) == SCRATCH == RECORDED.parent / "runs" / "results"
    assert results_folder(parser.parse_args(["--record"])) == RECORDED
