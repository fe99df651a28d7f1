"""Triton kernels not yet run on a GPU compile for one (sm_90, the H100/H200) on the CPU: ``triton.compile`` down
to a cubin with the ``ptxas`` of the Triton wheel, no device needed. The interpreter (TRITON_INTERPRET=1) checks what
a kernel computes but not that the compiler accepts it (types, layouts, reductions); this checks the latter. The
compiler runs in a process of its own: with TRITON_INTERPRET=1 set (as the test suite sets it) Triton's own
library functions are interpreted ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specdec.kernels.tree_write import _tree_write_kernel

out = []
sig = {name: "*i64" for name in ("src_ptr", "ids_ptr", "pos_ptr", "mask_ptr", "par_ptr")}
sig["live_ptr"] = "*i1"
sig.update({name: "*i64" for name in ("tok_out_ptr", "par_out_ptr", "top_ptr")})
sig.update({name: "i32" for name in ("m", "n", "levels", "q")})
for block in (16, 64):
    for live in (False, True):
        src = ASTSource(fn=_tree_write_kernel, signature={**sig, "BLOCK": "constexpr", "LIVE": "constexpr"},
                        constexprs={"BLOCK": block, "LIVE": live})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        out.append({"block": block, "live": live, "cubin": len(k.asm["cubin"]),
                    "entry": ".entry _tree_write_kernel" in k.asm["ptx"]})
print(json.dumps(out))
"""


@pytest.mark.skipif(not _PTXAS.is_file(), reason="the Triton wheel has no CUDA backend (ptxas) here")
def test_tree_write_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got) == 4 and all(k["cubin"] > 0 and k["entry"] for k in got), got
