"""The trainers' shared command-line parts (classify.cli): defaults, checks, runtime."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
import torch

from classify import pretrain, train
from classify.cli import check_run_args, runtime
from classify.errors import ClassifyError, run_cli
from classify.seq2seq import cli as seq2seq_cli
from classify.seq2seq.task import Seq2SeqTrainConfig


def seq2seq_train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    seq2seq_cli.add_train_parser(parser.add_subparsers(dest="command"))
    return parser._subparsers._group_actions[0].choices["train"]


PARSERS = [(train.build_parser, train.TrainConfig), (pretrain.build_parser, pretrain.PretrainConfig),
           (seq2seq_train_parser, Seq2SeqTrainConfig)]


@pytest.mark.parametrize("make_parser, config", PARSERS, ids=["train", "pretrain", "seq2seq"])
def test_every_stored_field_is_a_flag_whose_default_is_the_configs(make_parser, config):
    defaults = {a.dest: a.default for a in make_parser()._actions}
    for field in fields(config):
        assert field.name in defaults, f"{config.__name__}.{field.name} has no flag"
        if field.name != "data":  # --data defaults to $CLASSIFY_DATA or the hub id, or is required
            assert defaults[field.name] == field.default, field.name


def test_stored_config_round_trips_the_parsed_flags():
    args = train.build_parser().parse_args(["--output", "x", "--lr", "5e-4", "--time-budget", "30", "--threads", "1"])
    model, config = train.configs_from_args(args)
    assert (config.lr, config.time_budget, config.threads, config.epochs) == (5e-4, 30.0, 1, 3)
    assert "threads" not in train.TrainConfig.IDENTITY  # how many threads a run used may change on resume
    assert model.d_model == args.d_model == 128


@pytest.mark.parametrize("flags, message", [
    (["--time-budget", "-1"], "--time-budget must not be negative"),
    (["--warmup", "-5"], "--warmup must not be negative"),
    (["--lr", "0"], "--lr must be positive"),
    (["--layers", "0"], "--layers must be positive"),
    (["--max-steps", "0"], "--max-steps must be positive"),
    (["--d-model", "30", "--heads", "4"], "not divisible"),
    (["--dropout", "1"], "--dropout must be in [0, 1)"),
])
@pytest.mark.parametrize("module", [train, pretrain], ids=["train", "pretrain"])
def test_bad_run_flags_are_one_line_errors(module, flags, message, tmp_path, capsys):
    assert run_cli(module.main, ["--output", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_config_default_names_a_missing_field():
    assert train.TrainConfig.default("lr") == 1e-3
    with pytest.raises(KeyError, match="no field 'nope'"):
        train.TrainConfig.default("nope")


def test_time_budget_zero_is_allowed():
    args = train.build_parser().parse_args(["--output", "x", "--time-budget", "0"])
    check_run_args(args, {})


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
