"""Packaging promises: ``import paged_ops`` needs only torch; the HF names load lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_paged_ops_loads_no_optional_package() -> None:
    loaded = _run(
        "import sys, paged_ops; "
        "print(sorted(m for m in ('transformers', 'triton', 'flashinfer', 'torch._dynamo') "
        "if m in sys.modules))"
    )
    assert loaded == "[]"


def test_hf_names_import_lazily_and_register_the_attention_name() -> None:
    pytest.importorskip("transformers")
    out = _run(
        "import paged_ops; from paged_ops import patch_model, unpatch_model, PagedCache; "
        "from transformers import AttentionInterface; "
        "print(patch_model.__module__, 'paged_ops' in AttentionInterface._global_mapping)"
    )
    assert out == "paged_ops.integrations.transformers True"
