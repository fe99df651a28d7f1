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


_COMPILE_CHOICE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specdec.kernels.gumbel_choice import _choose_kernel, _filtered_choice_kernel
from specdec.kernels.gumbel_split import _gumbel_max_partials_kernel, _pick_kernel

def build(fn, sig, consts, warps):
    src = ASTSource(fn=fn, signature={**sig, **{name: "constexpr" for name in consts}}, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    entry = f".entry {fn.__name__}" in k.asm["ptx"]
    return {"kernel": fn.__name__, **consts, "cubin": len(k.asm["cubin"]), "entry": entry}

rows = {"x_ptr": "*bf16", "t_ptr": "*fp64", "key0_ptr": "*i64", "key1_ptr": "*i64", "pos_ptr": "*i64"}
parts = {"best_ptr": "*fp64", "first_ptr": "*i32", "xmax_ptr": "*fp32"}
strides = ("stride_x", "stride_t", "stride_key0", "stride_key1", "stride_pos")
out = [build(_gumbel_max_partials_kernel, {**rows, **parts, "n_cols": "i32", "chunk": "i32",
                                           **{n: "i32" for n in strides}},
             {"BLOCK": 1024, "NO_INDEX": 2**31 - 1, "ROUGH": rough}, 4) for rough in (False, True)]
out += [
        build(_pick_kernel, {**parts, "out_ptr": "*i64", "n_split": "i32"}, {"SPLIT": 64, "NO_INDEX": 2**31 - 1}, 4)]
sig = {**rows, "k_ptr": "*i64", "p_ptr": "*fp64", "min_p_ptr": "*fp64", "out_ptr": "*i64", "done_ptr": "*i32",
       **{"part_" + n: t for n, t in parts.items()}}
sig.update({n: "i32" for n in ("n_split", "n_cols", "rows_per_param", "max_rounds", *strides, "stride_k",
                               "stride_p", "stride_min_p")})
for split in (1, 64):
    out.append(build(_filtered_choice_kernel, sig, {"HAS_MIN_P": True, "BLOCK": 2048, "NO_INDEX": 2**31 - 1,
                                                    "SPLIT": split}, 16))
sig = {**rows, "kept_ptr": "*i1", "rule_i_ptr": "*i32", "rule_f_ptr": "*fp32", "skip_ptr": "*i32", "out_ptr": "*i64",
       **{n: "i32" for n in ("n_cols", "stride_x", "stride_kept", "stride_t", "stride_key0", "stride_key1",
                             "stride_pos")}}
for kept, rule in ((False, False), (True, False), (False, True)):
    out.append(build(_choose_kernel, sig, {"HAS_KEPT": kept, "HAS_RULE": rule, "SKIP": rule, "BLOCK": 2048,
                                           "NO_INDEX": 2**31 - 1}, 16))
print(json.dumps(out))
"""


@pytest.mark.skipif(not _PTXAS.is_file(), reason="the Triton wheel has no CUDA backend (ptxas) here")
def test_split_choice_kernels_compile_for_sm90():
    """The Gumbel-max choice's split pass 1 (partials, the unfiltered pick), the filtered choice over its partials
    (SPLIT 64) or walking pass 1 itself (SPLIT 1), and the one-program choice unfiltered, over a kept mask and over a
    kept-set rule with skipped rows (each scoring exactly only where the rough noise says a column could win)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_CHOICE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got) == 8 and all(k["cubin"] > 0 and k["entry"] for k in got), got


_COMPILE_PROCESSORS = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specdec.kernels.logit_processors import _processed_kernel

sig = {"x_ptr": "*bf16", "out_ptr": "*fp32", "n_cols": "i32", "x_stride": "i32", "q": "i32", "bias_ptr": "*fp32",
       "held_ptr": "*u8", "early_ptr": "*u8", "banned_ptr": "*i64", "n_banned": "i32", "present_ptr": "*u8",
       "penalty_ptr": "*fp32", "counts_ptr": "*fp32", "presence_ptr": "*fp32", "frequency_ptr": "*fp32",
       "path_ptr": "*i64", "n_path": "i32", "parts": "i32"}
out = []
for dtype in ("*bf16", "*fp32"):
    src = ASTSource(fn=_processed_kernel, signature={**sig, "x_ptr": dtype, "BLOCK": "constexpr"},
                    constexprs={"BLOCK": 1024})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
    out.append({"cubin": len(k.asm["cubin"]), "entry": ".entry _processed_kernel" in k.asm["ptx"],
                "fma": "fma.rn.f32" in k.asm["ptx"]})
print(json.dumps(out))
"""


@pytest.mark.skipif(not _PTXAS.is_file(), reason="the Triton wheel has no CUDA backend (ptxas) here")
def test_logit_processors_kernel_compiles_for_sm90_without_fused_multiply_add():
    """The processors' one pass (which parts run is an argument: one kernel for every batch) compiles for bf16 and
    float32 logits, and its PTX has no fused multiply-add (its count penalty rounds each product, as the torch
    reference does)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_PROCESSORS], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got) == 2 and all(k["cubin"] > 0 and k["entry"] and not k["fma"] for k in got), got
