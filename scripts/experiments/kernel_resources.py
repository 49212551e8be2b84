"""Registers, spills and shared memory of our Triton kernels, compiled for a GPU on any machine (no GPU needed).

    pip install triton        # (the CUDA builds of PyTorch bring it; the CPU ones do not)
    python scripts/experiments/kernel_resources.py OUTDIR [--arch 90]

The question: does a kernel hold so many registers (or so much shared memory) that an SM can keep only
a few of its programs at once, so that a launch of a few hundred programs runs in several waves? Triton
ships NVIDIA's assembler (ptxas) and cuobjdump, so a kernel compiles for a GPU target without the GPU:
each kernel here is compiled at the settings a decode step launches it with, with the specialization
Triton's launcher gives such a call (pointers and integer arguments divisible by 16 marked so, an
integer equal to 1 made a constant; without the marks the decode kernel's addresses are not vectorized
and it takes twice the registers), and cuobjdump reads the registers per thread and the stack (spills)
from the cubin. Programs per SM: the fewest of what the registers, the shared memory and the warps
allow (an H100/H200 SM: 65,536 registers, 227 KB of shared memory per block group, 64 warps, 32
blocks). Writes OUTDIR/kernel_resources.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
try:
    import triton
    import triton.compiler as tc
    from triton.backends.compiler import GPUTarget
except ImportError:
    raise SystemExit("kernel_resources.py compiles Triton kernels: pip install triton") from None
from minibatch.model import triton_decode  # noqa: E402
from minibatch.speed import gated, skinny  # noqa: E402

SM = {"registers": 65536, "shared": 227 * 1024, "warps": 64, "blocks": 32}
INDEX_POINTERS = ("kvi_ptr", "kvs_ptr", "kvp_ptr", "pos_ptr", "cm_ptr")
FLOAT32_POINTERS = ("m_ptr", "l_ptr", "acc_ptr", "p_ptr")


def decode_settings(group: int, split: bool, pdl: bool, fresh: bool = False) -> dict:
    """triton_decode.paged_decode's launch of the decode kernel (head_dim 128, bf16, 9 splits); `fresh`:
    model/fresh.py's (q/k/v from their projections, normed, rotated and cached by the kernel)."""
    return dict(G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=128, BLOCK_N=triton_decode.BLOCK_N,
                WINDOW=0, IEEE=False, SPLIT=split, PDL=pdl, LINE=64, FRESH=fresh, NORM=fresh)


def skinny_settings(rows: int, pdl: bool, n: int = 1024) -> dict:
    """skinny.launch's constants for `rows` rows at the setting skinny.settings ships (for an n-column product
    that `WIDEST` lets in)."""
    saved, skinny.WIDEST = skinny.WIDEST, {8: 8192}
    s = skinny.settings(rows, n, 1024)
    skinny.WIDEST = saved
    return _skinny_constants(s, rows, pdl)


def _skinny_constants(s: dict, rows: int, pdl: bool, gate: bool = False, fp32: bool = False) -> dict:
    """skinny.launch's constants for setting `s` (and, with `fp32`, float32 pointers: `_ptr_type`)."""
    dot = s.get("dot", False)
    out = dict(BLOCK_M=max(16 if dot else 1, triton.next_power_of_2(rows)), BLOCK_N=s["block_n"], BLOCK_K=s["block_k"],
               STAGES=s["stages"], SPLIT=False, DOT=dot, PDL=pdl, LINE=64 if not fp32 else 32,
               DEFER=s.get("defer", False) and not dot, GATE=gate, IEEE=fp32)
    return {**out, "_ptr_type": "*fp32"} if fp32 else out


def kernels() -> list[tuple[str, object, dict, dict, int, int]]:
    """(label, kernel, constants, integer arguments, warps, stages): launches a decode step makes, at context
    512 (576 keys per row) with head_dim 128; the skinny product is a 0.6B attention output (1024 x 2048)."""
    out = []
    for group, heads, model in ((2, 16, "0.6B"), (4, 32, "8B")):
        ints = dict(sq_r=128, sq_h=4 * 128, sk_s=8 * 128, sk_h=128, sv_s=8 * 128, sv_h=128, so_r=heads * 128, so_h=128,
                    L=576, keys_per_split=64)
        for pdl, (warps, stages) in ((False, (4, 3)), (True, (4, 3)), (True, (2, 2))):  # 2, 2: at 4-64 rows
            out.append((f"decode attention, {model}, pdl={int(pdl)}, {warps} warps, {stages} stages",
                        triton_decode._decode_kernel, decode_settings(group, True, pdl), ints, warps, stages))
    # the 0.6B step with fresh.ENABLED: q, k and v read from the merged q/k/v product's rows (4096 wide)
    ints = dict(sq_r=4096, sq_h=128, sk_s=8 * 128, sk_h=128, sv_s=8 * 128, sv_h=128, so_r=16 * 128, so_h=128, L=576,
                keys_per_split=64, skn_r=4096, svn_r=4096, scs_r=128, scs_d=1)
    for warps, stages in ((4, 3), (2, 2)):
        out.append((f"decode attention, 0.6B, fresh, pdl=1, {warps} warps, {stages} stages",
                    triton_decode._decode_kernel, decode_settings(2, True, True, fresh=True), ints, warps, stages))
    out.append(("decode combine, 0.6B, 9 splits", triton_decode._combine_kernel,
                dict(S=9, BLOCK_S=16, D=128, PDL=True), dict(so_r=16 * 128, so_h=128, H=16), 4, 3))
    for rows, pdl in ((1, False), (1, True), (4, False), (4, True)):
        c = skinny_settings(rows, pdl)
        ints = dict(M=rows, N=1024, K=2048, pieces=2048 // c["BLOCK_K"], sxm=2048, swn=2048, sym=1024)
        label = f"skinny product, {rows} row{'s' * (rows > 1)}, pdl={int(pdl)}"
        out.append((label, skinny._skinny_kernel, c, ints, 4, c["STAGES"]))
    for rows in (1, 4):  # the 0.6B merged q/k/v product (4096 x 1024)
        c = skinny_settings(rows, True, n=4096)  # with a rule that lets it in; 8 rows: as 4 (16-row tiles)
        ints = dict(M=rows, N=4096, K=1024, pieces=1024 // c["BLOCK_K"], sxm=1024, swn=1024, sym=4096)
        label = f"skinny, q/k/v, {rows} row{'s' * (rows > 1)}, pdl=1"
        out.append((label, skinny._skinny_kernel, c, ints, 4, c["STAGES"]))
    # the 0.6B merged gate/up product with silu(gate) * up inside (gated.py; 3072 outputs x 1024 inputs); float32
    # as the GPU tests' models run it (2 stages: gated.chosen_setting)
    for rows, fp32 in ((1, False), (4, False), (8, False), (4, True)):
        s = gated.settings(rows, 3072, 1024)
        if fp32 and s.get("dot"):
            s = {**s, "stages": 2}
        c = _skinny_constants(s, rows, True, gate=True, fp32=fp32)
        ints = dict(M=rows, N=3072, K=1024, pieces=1024 // c["BLOCK_K"], sxm=1024, swn=1024, sym=3072,
                    up_offset=3072 * 1024)
        label = (f"skinny gated, gate/up, {rows} row{'s' * (rows > 1)}, "
                 f"{'float32' if fp32 else 'bf16'}, {c['STAGES']} stages, pdl=1")
        out.append((label, skinny._skinny_kernel, c, ints, 4, c["STAGES"]))
    return out


def compile_for(fn, constants: dict, ints: dict, warps: int, stages: int, arch: int):
    """The kernel compiled as Triton's launcher would for these values: an integer argument equal to 1
    becomes a constant, one divisible by 16 (and every pointer) is marked so."""
    names = fn.arg_names
    constants = dict(constants)
    ptr_type = constants.pop("_ptr_type", "*bf16")  # (the tensors' element type: bf16 unless a launch says)
    constants = {**constants, **{k: v for k, v in ints.items() if v == 1}}
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = ("*i64" if name in INDEX_POINTERS else "*fp32" if name in FLOAT32_POINTERS
                               else "*i32" if name == "count_ptr" else ptr_type)
        else:
            signature[name] = "fp32" if name in ("scale", "eps") else "i32"
        if name.endswith("_ptr") or ints.get(name, 1) % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = tc.ASTSource(fn=fn, signature=signature, attrs=attrs,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 128), options=dict(num_warps=warps, num_stages=stages))


def resources(kernel) -> dict:
    """Registers per thread and stack bytes (spills) from the cubin, shared memory from Triton's metadata."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    usage = dict(re.findall(r"(REG|STACK):(\d+)", text))
    return {"registers": int(usage["REG"]), "stack": int(usage["STACK"]), "shared": kernel.metadata.shared}


def per_sm(r: dict, warps: int) -> dict:
    """How many of the kernel's programs an SM holds, by each limit (registers allocated per warp, in
    multiples of 256)."""
    per_warp = -(-r["registers"] * 32 // 256) * 256
    limits = {"registers": SM["registers"] // (per_warp * warps), "warps": SM["warps"] // warps, "blocks": SM["blocks"],
              "shared": SM["shared"] // max(r["shared"], 1)}
    return {"programs": min(limits.values()), "limited_by": min(limits, key=limits.get), **limits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    print(f"{'kernel':42} {'warps':>5} {'regs':>5} {'spill B':>7} {'shared B':>8} {'per SM':>6}  limited by")
    for label, fn, constants, ints, warps, stages in kernels():
        r = resources(compile_for(fn, constants, ints, warps, stages, args.arch))
        fit = per_sm(r, warps)
        rows.append({"kernel": label, "warps": warps, "stages": stages, "constants": constants, **r, "per_sm": fit})
        print(f"{label:42} {warps:5d} {r['registers']:5d} {r['stack']:7d} {r['shared']:8d} {fit['programs']:6d}  "
              f"{fit['limited_by']}", flush=True)
    (out / "kernel_resources.json").write_text(json.dumps({"triton": triton.__version__, "arch": args.arch,
                                                           "sm": SM, "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
