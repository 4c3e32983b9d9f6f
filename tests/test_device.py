"""The device module: choice, autocast dtype, transfers, and one-line errors for impossible requests."""

import os
import subprocess
import sys

import pytest
import torch

from classify.engine.device import autocast, autocast_dtype, grad_scaler, pin_memory, resolve_device, to_device
from classify.errors import ClassifyError


def test_cpu_choices():
    cpu = resolve_device("cpu")
    assert cpu.type == "cpu" and not pin_memory(cpu)
    assert autocast_dtype(cpu, "fp32") is None
    assert autocast_dtype(cpu, "auto") in (torch.bfloat16, None)
    assert not grad_scaler(cpu, torch.bfloat16).is_enabled()
    assert resolve_device("auto").type in ("cpu", "cuda", "mps")


def test_impossible_requests_are_user_errors():
    cpu = torch.device("cpu")
    with pytest.raises(ClassifyError, match="fp16"):
        autocast_dtype(cpu, "fp16")
    with pytest.raises(ClassifyError, match="precision"):
        autocast_dtype(cpu, "fp8")
    with pytest.raises(ClassifyError, match="unknown device"):
        resolve_device("tpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(ClassifyError, match="CUDA is not available"):
            resolve_device("cuda")


def test_a_cuda_ordinal_the_machine_lacks_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("set_device reached"))
    with pytest.raises(ClassifyError, match="CUDA device 7 was asked for but this machine has 2"):
        resolve_device("cuda:7")


def test_to_device_nested_and_autocast_runs():
    cpu = torch.device("cpu")
    batch = {"tokens": torch.ones(2, 3), "meta": [torch.zeros(1), "keep"]}
    moved = to_device(batch, cpu)
    assert moved["meta"][1] == "keep" and moved["tokens"].device == cpu
    dtype = autocast_dtype(cpu, "auto")
    with autocast(cpu, dtype):
        out = torch.nn.Linear(3, 2)(torch.ones(1, 3))
    assert out.dtype == (dtype or torch.float32)


def _huge_pages_on_request() -> bool:
    """The kernel backs memory with huge pages where a program asks (madvise), not always or never."""
    try:
        return "[madvise]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _huge_pages_on_request(), reason="needs Linux transparent huge pages in madvise mode")
def test_importing_classify_puts_torch_cpu_tensors_on_huge_pages():
    """A 256 MiB tensor made after ``import classify`` faults in 2 MiB pages, not 4 KiB ones (~65,000 faults);
    THP_MEM_ALLOC_ENABLE=0 set by the user keeps the small pages."""
    probe = ("import resource, classify, torch\n"
             "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
             "x = torch.ones(64 << 20)\n"
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")

    def faults(**env: str) -> int:
        inherited = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}  # this process set it
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                             env={**inherited, **env})
        return int(out.stdout.split()[-1])

    assert faults() < 5_000
    assert faults(THP_MEM_ALLOC_ENABLE="0") > 30_000
