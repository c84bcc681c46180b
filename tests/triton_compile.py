"""Compile every configuration of the GPU decoder's Triton kernels (and of the packed forward's decode attention,
``engine/model/decode_kernel.py``) for an H100 (sm_90) to machine code, on a
machine without a GPU: ``python -m tests.triton_compile``; one line per kernel configuration, exit 1 on the
first that does not compile. Run without ``TRITON_INTERPRET`` (the interpreter accepts code the compiler
refuses: ``tests/test_triton_compile.py``)."""

from __future__ import annotations

import inspect
import sys

KV_TYPES = {"steps": "*fp32", "means": "*fp32", "cos": "*fp32", "sin": "*fp32", "stride_l": "i64", "stride_h": "i64",
            "stride_t": "i64", "first_token": "i32", "layers": "i32", "heads": "i32", "min_symbol": "i32"}  # fmt: skip
COMMON = {"words": "*i16", "word_off": "*i64", "sym_off": "*i64", "order": "*i64", "prog_rounds": "*i64", "n_streams": "i32",
          "table_ids": "*i32", "ids_stride": "i32", "period": "i32", "info": "*u32", "alphabet": "i32", "status": "*i32"}  # fmt: skip


def _attention_types(kind: str) -> dict[str, str]:
    tables = dict.fromkeys(("qrow_ptr", "orow_ptr", "kaddr_ptr", "vaddr_ptr", "stride_l_ptr", "stride_h_ptr", "first_ptr", "filled_ptr"), "*i64")
    strides = dict.fromkeys(
        ("q_stride_h", "q_stride_t", "kn_stride_h", "kn_stride_t", "vn_stride_h", "vn_stride_t", "o_stride_t", "o_stride_h"), "i64"
    )
    return {"q_ptr": kind, "kn_ptr": kind, "vn_ptr": kind, "out_ptr": kind, "lse_ptr": "*fp32", "layer": "i32", "scale": "fp32", **tables, **strides}


def configurations() -> list[tuple[str, dict[str, str], dict[str, object]]]:
    """(kernel, pointer and scalar types, constexprs) as ``TritonDecoder._run`` launches them (its default streams
    per program; the 256-symbol alphabet; every head-dim case of the rotary pairing; float32, float16 and
    bfloat16 outputs, the components' float32 without the mean), then the decode attention as ``own_decode.attend``
    launches it (no grouping, 4 and 3 query heads a KV head; head_dim 128 and 64; with and without the log-sum-exp)."""
    from cachegen_core.coders.triton_decoder import _gpu_streams, kv_meta
    from cachegen_core.engine.model.own_decode import block, triton_pow2

    base = {"S": _gpu_streams(), "STEPS": 8, "POW2": True}
    out = [("decode_symbols_kernel", {**COMMON, "out": "*u8"}, base)]
    for head_dim, rotary in ((8, True), (16, True), (64, True), (128, True), (128, False), (256, True)):
        for add_mean, kind in ((True, "*i16"), (True, "*fp16"), (True, "*fp32"), (False, "*fp32")):
            meta = kv_meta(head_dim, rotary=rotary, add_mean=add_mean, bf16=kind == "*i16")
            out.append(("decode_kv_kernel", {**COMMON, **KV_TYPES, "out_k": kind, "out_v": kind}, {**base, **meta}))
    for kind in ("*bf16", "*fp16", "*fp32"):
        for g, head_dim, lse in ((1, 128, False), (4, 128, True), (3, 64, True), (3, 64, False)):
            gp, dp = triton_pow2(g), triton_pow2(head_dim)
            consts = {"G": g, "GP": gp, "D": head_dim, "DP": dp, "BLOCK": block(gp, dp), "WRITE_LSE": lse}
            out.append(("own_decode_kernel", _attention_types(kind), consts))
    return out


def main() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from cachegen_core.coders import triton_kernels
    from cachegen_core.coders.triton_decoder import gpu_options
    from cachegen_core.engine.model import decode_kernel

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        print(f"SKIP: Triton {triton.__version__}'s ASTSource takes no constexprs")
        return 0
    for name, types, consts in configurations():
        fn = getattr(triton_kernels, name, None) or getattr(decode_kernel, name)
        signature = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=consts)
        options = gpu_options(int(consts["S"])) if "S" in consts else {"num_warps": 4}
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)  # type: ignore[call-overload]
        except Exception as e:  # noqa: BLE001  the compiler's own error types vary across Triton versions
            print(f"FAIL {name} {consts}: {type(e).__name__}: {e}")
            return 1
        print(f"ok {name} {consts} cubin={len(kernel.asm['cubin'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
