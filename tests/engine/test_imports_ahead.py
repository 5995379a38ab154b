"""Kernel libraries imported on a thread while the weights load
(dsmesh/engine/runner/imports_ahead.py): which modules, and the thread that imports them."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from dsmesh.engine.model.config import load_config
from dsmesh.engine.model.tiny_model import default_model_dir
from dsmesh.engine.options import EngineConfig
from dsmesh.engine.runner.imports_ahead import ImportsAhead, kernel_modules
from dsmesh.kernels._triton import triton_importable


def test_a_cpu_engine_imports_nothing_ahead() -> None:
    mc = load_config(default_model_dir())
    assert kernel_modules(EngineConfig(device="cpu"), torch.device("cpu"), mc) == []


def test_a_cuda_engine_imports_what_its_kernel_choice_will() -> None:
    # the rule only: a CUDA device object needs no GPU
    mc = load_config(default_model_dir())
    cuda = torch.device("cuda")
    triton = ["triton", "triton.language"] if triton_importable() else []
    assert kernel_modules(EngineConfig(kernels="torch"), cuda, mc) == []
    # the tiny model's latent is not DeepSeek's 512 + 64: FlashInfer never serves it on auto
    assert kernel_modules(EngineConfig(dtype="bfloat16"), cuda, mc) == triton
    flashinfer = EngineConfig(dtype="bfloat16", decode_attention="flashinfer")
    assert kernel_modules(flashinfer, cuda, mc) == (triton + ["flashinfer"] if triton else [])
    # two-batch overlap runs the MLA decode through Triton whatever was asked
    tbo = EngineConfig(dtype="bfloat16", decode_attention="flashinfer", tbo=True)
    assert kernel_modules(tbo, cuda, mc) == triton


def test_imports_run_on_a_thread_and_failures_are_kept_for_the_kernel_choice() -> None:
    code = """
        import sys, threading
        from dsmesh.engine.runner.imports_ahead import ImportsAhead
        names = {}
        class Witness:  # records the thread each module's import ran on
            def find_spec(self, name, path=None, target=None):
                names.setdefault(name, threading.current_thread().name)
        sys.meta_path.insert(0, Witness())
        ahead = ImportsAhead(["colorsys", "sys", "no_such_module_here", "wave"])
        ahead.wait()
        print(ahead.modules)
        print(names["colorsys"], names["wave"], "colorsys" in sys.modules, "wave" in sys.modules)
        print(ahead.failed)
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    modules, imported, failed = proc.stdout.splitlines()
    assert modules == "('colorsys', 'no_such_module_here', 'wave')"  # sys: loaded already
    assert imported == "imports-ahead imports-ahead True True"  # past the failed one too
    assert failed == (
        "{'no_such_module_here': \"ModuleNotFoundError: No module named 'no_such_module_here'\"}"
    )


def test_nothing_to_import_starts_no_thread() -> None:
    ahead = ImportsAhead(["sys", "torch"])
    assert ahead.modules == ()
    ahead.wait()
