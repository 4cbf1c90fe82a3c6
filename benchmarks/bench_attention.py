"""How fast is pegainfer's paged attention, decode and prefill, and which split / tile geometry should it take?

* Decode (batch 1, the split-K path as a decode step runs it: one launch, the last block of each kv head merges the
  splits): time per call and the bandwidth it reaches reading the K/V of the context, for contexts 512, 4096 and
  32768, with Qwen3-4B shapes (32 q / 8 kv heads x 128) and Qwen3.5's full-attention shapes (16 / 4 x 256), page
  size 16, pages shuffled, ``max_model_len`` 32768 (which, with T, fixes the number of splits).  Each "layer" has
  its own cache, and a CUDA graph replays calls round-robin over enough layers (>= 256 MB of K/V) that the K/V
  comes from HBM, not from the 50 MB L2 -- as in a real decode step.
* Batched decode (``--batch B``): one decode call of B sequences, each its newest token at ``--batch-context``
  keys (default 256) on its own shuffled pages, Qwen3-4B's heads (``--shapes``: others): µs per call and the
  bandwidth of its K/V reads, at the default geometry and at each ``--decode-geometry W,P[,S,K,B]`` (W warps a
  block, P = 1: in pairs over the head dims; B: blocks an SM of a grid that walks the items), with the output
  checked against the default geometry's.  As a 64-stream server's decode step runs it.
* Prefill: one prompt of 2048, 8192 and 32768 tokens (positions 0 .. T-1, one slot, shuffled 16-token pages), the
  tiled tensor-core kernel (``paged_attention(method="prefill")``) on both shapes: µs per call and causal TFLOP/s
  (``4 · T²/2 · D · nq``: QK^T and PV over the keys at or before each query), beside torch's
  ``scaled_dot_product_attention`` (flash backend, causal, GQA) on the same q / K / V in the same run -- the peer
  (torch is imported only here, as a yardstick).  Sanity checks: the relative L2 difference of the two outputs,
  and at 2048 tokens that of the split-K kernel's.
* ``--prefill-geometry W,M,BK,S`` (repeatable) times forced tiles of the prefill kernel (warps, m16 tiles a warp,
  keys a K/V tile, ring stages: ``attention.PrefillGeometry``) beside the default, every shape and length.
* ``--sweep`` (minutes: each geometry is a compile): decode geometries (warps per block, warp pairs over the head
  dims), split counts and minimum split sizes, prefill tiles, and the split-vs-tiled crossover
  for chunks of T tokens after a 4096-token prefix -- the numbers behind the split geometry, ``attention_num_splits``
  / ``MIN_SPLIT_TOKENS``, the prefill geometry and ``PREFILL_MIN_TOKENS``.

Times come from CUDA-graph replays (an eager numba launch costs ~20 us of host time, more than the kernels); torch's
from CUDA events around back-to-back calls.  Without a GPU it runs as a smoke test in the simulator (tiny shapes,
wall-clock times, no graphs, no torch).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import graph_timing  # noqa: E402  (puts the checkout on sys.path)
from graph_timing import time_calls  # noqa: E402

import numpy as np  # noqa: E402

import pegainfer  # noqa: E402

SIM = pegainfer.SIMULATOR
PAGE = 16
MAX_MODEL_LEN = 32768
MODELS = {"qwen3-4b": (32, 8, 128), "qwen3.5-full": (16, 4, 256)}
CONTEXTS = (512, 4096, 32768)
PREFILL_TOKENS = (2048, 8192, 32768)
SPLIT_CHECK_TOKENS = 2048      # the split-K kernel's output is compared with the tiled one's up to this length
HBM_SET_BYTES = 256 << 20      # K/V bytes cycled through per graph, > 5x the H200's L2
if SIM:
    PAGE, MAX_MODEL_LEN, CONTEXTS, PREFILL_TOKENS, SPLIT_CHECK_TOKENS, HBM_SET_BYTES = 4, 64, (9, 40), (24,), 24, 0
    MODELS = {"tiny": (4, 2, 32)}


def attention_api() -> SimpleNamespace:
    """The ``pegainfer.kernels.attention`` names this script uses.  Beyond the public ``paged_attention``,
    ``attention_workspace_size``, ``attention_num_splits`` and the split constants, the sweep forces geometries
    through the launchers and pickers behind ``paged_attention`` (``paged_attention_split`` /
    ``paged_attention_prefill`` with ``geometry=``, ``split_geometry``, ``prefill_geometry``), found wherever the
    package keeps them (``graph_timing.kernel_name``, underscore or not)."""
    pkg = "pegainfer.kernels.attention"
    find = lambda *names: graph_timing.kernel_name(pkg, *names)  # noqa: E731
    return SimpleNamespace(
        paged_attention=find("paged_attention"), workspace_size=find("attention_workspace_size"),
        num_splits=find("attention_num_splits"), min_split_tokens=find("MIN_SPLIT_TOKENS"),
        min_split_tokens_wide=find("MIN_SPLIT_TOKENS_WIDE"),
        split=find("paged_attention_split", "_paged_attention_split"),
        prefill=find("paged_attention_prefill", "_paged_attention_prefill"),
        split_geometry=find("split_geometry", "_split_geometry"),
        prefill_geometry=find("prefill_geometry", "_prefill_geometry"),
        geometry=find("PrefillGeometry"), split_geometry_type=find("SplitGeometry"))


A = None   # attention_api(), set by main


def min_chunk(min_split_tokens, D) -> int:
    """Fewest keys a split covers (the forced value, else the kernel's default for this head width)."""
    if min_split_tokens is None:
        min_split_tokens = A.min_split_tokens_wide if D > 128 else A.min_split_tokens
    return max(1, min_split_tokens)


def random_bf16(shape, rng):
    """Device bf16 bits of N(0, 1) values (rounded), so that softmax sees realistic, non-degenerate scores."""
    from numba import cuda
    bits = (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return cuda.to_device(bits)


class Layers:
    """``n`` independent K/V caches of ``batch`` slots (one by default), each holding ``ctx`` tokens on its own
    shuffled pages, and their block table."""

    def __init__(self, n, ctx, nkv, D, rng, batch=1):
        from numba import cuda
        per_slot = -(-ctx // PAGE)
        pages = batch * per_slot
        self.k = [random_bf16((pages, PAGE, nkv, D), rng) for _ in range(n)]
        self.v = [random_bf16((pages, PAGE, nkv, D), rng) for _ in range(n)]
        table = np.zeros((batch, MAX_MODEL_LEN // PAGE), np.int32)
        table[:, :per_slot] = rng.permutation(pages).reshape(batch, per_slot)
        self.tables = cuda.to_device(table)
        self.n = n


_LAYERS: dict = {}


def layers_for(ctx, nkv, D, rng, cap=128):
    """The K/V caches of one (context, shape), built once and reused by every decode measurement (random data for
    256 MB takes seconds on the host)."""
    key = (ctx, nkv, D)
    if key not in _LAYERS:
        kv_bytes = 2 * ctx * nkv * D * 2
        n = 1 if SIM else int(min(cap, max(2, math.ceil(HBM_SET_BYTES / kv_bytes))))
        _LAYERS[key] = Layers(n, ctx, nkv, D, rng)
    return _LAYERS[key]


def bench_decode(rng, read_bw, rows, geometry=None, num_splits=None, min_split_tokens=None, models=None,
                 contexts=CONTEXTS, label="decode", quiet=False):
    from numba import cuda
    for model, (nq, nkv, D) in (models or MODELS).items():
        ws = cuda.device_array(A.workspace_size(1, nq, D, MAX_MODEL_LEN, nkv=nkv, num_splits=num_splits), np.float32)
        q = random_bf16((1, nq, D), rng)
        out = cuda.device_array((1, nq, D), np.uint16)
        slots = cuda.to_device(np.zeros(1, np.int32))
        for ctx in contexts:
            L = layers_for(ctx, nkv, D, rng)
            pos = cuda.to_device(np.array([ctx - 1], np.int32))

            def call(i):
                if geometry is None:        # the public entry point, as a decode step calls it
                    return lambda: A.paged_attention(q, L.k[i], L.v[i], L.tables, slots, pos, out, 1 / math.sqrt(D),
                                                     ws, num_splits=num_splits, min_split_tokens=min_split_tokens,
                                                     method="split", decode=True)
                return lambda: A.split(q, L.k[i], L.v[i], L.tables, slots, pos, out, 1 / math.sqrt(D), ws,
                                       num_splits=num_splits, min_split_tokens=min_split_tokens, geometry=geometry,
                                       decode=True)

            calls = [call(i % L.n) for i in range(max(L.n, 1 if SIM else 64))]
            sec = time_calls(calls)
            kv_bytes = 2 * ctx * nkv * D * 2
            splits = num_splits or A.num_splits(1, nkv, MAX_MODEL_LEN, D)
            least = min_chunk(min_split_tokens, D)
            chunk = -(-(-(-ctx // splits)) // least) * least
            row = dict(kind=label, model=model, nq=nq, nkv=nkv, D=D, ctx=ctx, splits=splits,
                       active_splits=-(-ctx // chunk), min_split_tokens=least,
                       geometry=list(geometry or A.split_geometry(D, nq // nkv, nkv)), layers=L.n, us=sec * 1e6,
                       GBps=kv_bytes / sec / 1e9, pct_of_read=100 * kv_bytes / sec / read_bw if read_bw else None)
            rows.append(row)
            if not quiet:
                print_decode_row(row)
    return rows


def bench_batch_decode(rng, read_bw, rows, batch, ctx, geometries=(None,), model="qwen3-4b"):
    """A decode call of ``batch`` sequences at ``ctx`` keys each, per geometry (None: the default; else
    ``(SplitGeometry, splits, min_keys)`` from ``parse_decode_geometry``, splits / min_keys None for the defaults);
    the outputs of forced geometries are compared with the default's (relative L2 of the bf16 outputs)."""
    from numba import cuda
    nq, nkv, D = MODELS[model] if model in MODELS else next(iter(MODELS.values()))
    kv_bytes = 2 * batch * ctx * nkv * D * 2
    n = 1 if SIM else int(min(64, max(2, math.ceil(HBM_SET_BYTES / kv_bytes))))
    L = Layers(n, ctx, nkv, D, rng, batch)
    q = random_bf16((batch, nq, D), rng)
    slots = cuda.to_device(np.arange(batch, dtype=np.int32))
    pos = cuda.to_device(np.full(batch, ctx - 1, np.int32))
    most = max([g[1] for g in geometries if g is not None and g[1]] or [1])
    ws = cuda.device_array(max(A.workspace_size(batch, nq, D, MAX_MODEL_LEN, nkv=nkv),
                               A.workspace_size(batch, nq, D, MAX_MODEL_LEN, nkv=nkv, num_splits=most)), np.float32)
    reference = None
    for geometry in geometries:
        out = cuda.device_array((batch, nq, D), np.uint16)

        def call(i, geometry=geometry, out=out):
            if geometry is None:
                return lambda: A.paged_attention(q, L.k[i], L.v[i], L.tables, slots, pos, out, 1 / math.sqrt(D), ws,
                                                 method="split", decode=True)
            block, splits, least = geometry
            return lambda: A.split(q, L.k[i], L.v[i], L.tables, slots, pos, out, 1 / math.sqrt(D), ws,
                                   geometry=block, num_splits=splits, min_split_tokens=least, decode=True)

        try:
            call(0)()
        except Exception as e:          # a forced block that does not compile or launch: say so, time the others
            print(f"  {model:12s} batch {batch:4d} ctx {ctx:6d}  {describe_forced(geometry)} forced: failed: "
                  f"{type(e).__name__}: {e}".splitlines()[0], flush=True)
            rows.append(dict(kind="batch", model=model, batch=batch, ctx=ctx, geometry=list(geometry[0]),
                             splits=geometry[1], min_split_tokens=geometry[2], forced=True,
                             error=f"{type(e).__name__}: {e}".splitlines()[0]))
            continue
        bits = out.copy_to_host()
        reference = bits if reference is None else reference
        sec = time_calls([call(i % L.n) for i in range(max(L.n, 1 if SIM else 16))])
        row = dict(kind="batch", model=model, batch=batch, ctx=ctx, layers=L.n,
                   geometry=list(geometry[0] if geometry else A.split_geometry(D, nq // nkv, batch * nkv)),
                   splits=geometry[1] if geometry else None, min_split_tokens=geometry[2] if geometry else None,
                   forced=geometry is not None,
                   us=sec * 1e6, GBps=kv_bytes / sec / 1e9,
                   pct_of_read=100 * kv_bytes / sec / read_bw if read_bw else None,
                   rel_l2_vs_default=bf16_rel_l2(bits, reference))
        rows.append(row)
        pct = f"{row['pct_of_read']:5.1f}%" if row["pct_of_read"] else "    - "
        label = describe_forced(geometry) if geometry else "default"
        print(f"  {model:12s} batch {batch:4d} ctx {ctx:6d}  {label:<34}"
              f"  {row['us']:9.2f} us  {row['GBps']:7.0f} GB/s  {pct}  rel-L2 vs default "
              f"{row['rel_l2_vs_default']:.1e}{'' if SIM else kernel_resources(row['geometry'], D, nq // nkv)}",
              flush=True)
    return rows


def parse_decode_geometry(text: str):
    """``W,P[,S[,K[,B]]]`` -> ``(SplitGeometry, splits, min_keys)``: W warps a block, in pairs over the head dims when
    P = 1; S splits per (token, kv head) and splits of at least K keys (0 or left out: the engine's); B blocks an SM
    of a grid that walks the work items (0 or left out: a block per item)."""
    try:
        warps, pairs, *rest = (int(v) for v in text.split(","))
        if len(rest) > 3 or any(v < 0 for v in rest) or warps < 1 or pairs not in (0, 1):
            raise ValueError
        splits, least, walk = (rest + [0, 0, 0])[:3]
        block = A.split_geometry_type(warps, bool(pairs), walk) if walk else A.split_geometry_type(warps, bool(pairs))
        return block, splits or None, least or None
    except (TypeError, ValueError):
        raise SystemExit(f"error: --decode-geometry {text!r}: expected warps,pairs[,splits[,min_keys[,walk]]] (pairs "
                         f"0 or 1; 0 for the engine's splits / keys / a block per item), e.g. 4,0 or 4,0,2,128 or "
                         f"4,0,0,0,2")


def describe_forced(geometry) -> str:
    block, splits, least = geometry
    walk = block[2] if len(block) > 2 else 0
    return (f"{block[0]} warps{' in pairs' if block[1] else ''}"
            + (f", {splits} splits" if splits else "") + (f" of >= {least} keys" if least else "")
            + (f", walking ({walk} blocks an SM)" if walk else ""))


def kernel_resources(block, D, G) -> str:
    """Registers and local memory (spills) a thread of the compiled decode split-K kernel of ``block`` uses (GPU
    only; empty where the tree's kernel builder differs)."""
    try:
        build = graph_timing.kernel_name("pegainfer.kernels.attention", "split_kernel")
        kern = build(D, G, block[0], True, False, block[1], False)
        regs, local = kern.get_regs_per_thread(), kern.get_local_mem_per_thread()
        regs = max(regs.values()) if isinstance(regs, dict) else regs
        local = max(local.values()) if isinstance(local, dict) else local
        return f"  {regs} regs, {local} B local"
    except Exception:
        return ""


def print_decode_row(r):
    pct = f"{r['pct_of_read']:5.1f}%" if r["pct_of_read"] else "    - "
    print(f"  {r['kind']:7s} {r['model']:13s} ctx {r['ctx']:6d}  splits {r['active_splits']:3d}/{r['splits']:3d} "
          f"(min {r['min_split_tokens']:3d} keys)  geom {tuple(r['geometry'])}  {r['us']:9.2f} us  {r['GBps']:7.0f} GB/s  "
          f"{pct}", flush=True)


class PrefillInputs:
    """One slot's prompt of ``prefix + T`` tokens for a prefill chunk of the last ``T``: q ``[T, nq, D]``, the K/V of
    every position scattered over shuffled pages of the paged cache, and the same K/V contiguous (``[ctx, nkv,
    D]``, what torch reads), all device bf16 bits of N(0, 1) values."""

    def __init__(self, rng, T, prefix, nq, nkv, D):
        from numba import cuda
        ctx = prefix + T
        pages = -(-ctx // PAGE)
        perm = rng.permutation(pages).astype(np.int32)
        table = np.zeros((1, max(pages, MAX_MODEL_LEN // PAGE)), np.int32)
        table[0, :pages] = perm
        self.tables = cuda.to_device(table)
        self.k_seq, self.v_seq, self.k, self.v = [], [], None, None
        for name in ("k", "v"):
            seq = random_bits((pages * PAGE, nkv, D), rng)
            cache = np.empty_like(seq).reshape(pages, PAGE, nkv, D)
            cache[perm] = seq.reshape(pages, PAGE, nkv, D)      # logical page i lives in physical page perm[i]
            setattr(self, name, cuda.to_device(cache))
            setattr(self, name + "_seq", cuda.to_device(seq[:ctx]))
        self.q = random_bf16((T, nq, D), rng)
        self.pos = cuda.to_device(np.arange(prefix, ctx, dtype=np.int32))
        self.slots = cuda.to_device(np.zeros(T, np.int32))
        self.shape, self.nkv, self.prefix, self.scale = (T, nq, D), nkv, prefix, 1 / math.sqrt(D)

    def workspace(self):
        from numba import cuda
        T, nq, D = self.shape
        return cuda.device_array(A.workspace_size(T, nq, D, MAX_MODEL_LEN, nkv=self.nkv), np.float32)

    def call(self, out, method="prefill", geometry=None, ws=None):
        """A function that runs the attention of the chunk into ``out``: ``paged_attention(method=)`` as a prompt
        chunk calls it, or the tiled kernel forced to ``geometry``."""
        if geometry is not None:
            return lambda: A.prefill(self.q, self.k, self.v, self.tables, self.slots, self.pos, out, self.scale,
                                     geometry=geometry)
        return lambda: A.paged_attention(self.q, self.k, self.v, self.tables, self.slots, self.pos, out,
                                         self.scale, ws, method=method)


def random_bits(shape, rng):
    """Host bf16 bits of N(0, 1) values."""
    return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def causal_flops(T, prefix, nq, D):
    """QK^T and PV of a causal chunk, 2 flops a multiply-add: ``4 · nq · D · (T²/2 + prefix · T)``."""
    return 4.0 * nq * D * (T * T / 2 + prefix * T)


def bf16_rel_l2(a_bits, b_bits, rows=None) -> float:
    """Relative L2 difference of two host bf16-bit arrays (over ``rows`` of the first axis when given)."""
    if rows is not None:
        a_bits, b_bits = a_bits[rows], b_bits[rows]
    a, b = ((x.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for x in (a_bits, b_bits))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


class TorchSDPA:
    """torch's ``scaled_dot_product_attention`` (flash backend, causal) on the chunk's q and contiguous K / V: zero-copy
    bf16 views of the same device arrays, heads moved to dim 1 by strides.  GQA by ``enable_gqa`` where this torch
    has it, else K / V repeated per q head (the kernel then reads G times the bytes; noted in the output)."""

    def __init__(self):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        self.torch, self.flash = torch, (lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION))
        self.how = None

    def view(self, arr):
        """``[tokens, heads, D]`` bf16 bits (a numba device array) as torch's ``[1, heads, tokens, D]`` bf16, no copy
        (through int16: torch's uint16 tensors are recent)."""
        t = self.torch.as_tensor(arr.view(np.int16), device="cuda")
        return t.view(self.torch.bfloat16).unsqueeze(0).transpose(1, 2)

    def prepare(self, inp):
        """The call for ``inp``; it leaves its output (``[1, nq, T, D]``) in ``self.out``."""
        T, nq, D = inp.shape
        if inp.prefix:
            raise ValueError("the torch peer times chunks without a prefix")
        q, k, v = self.view(inp.q), self.view(inp.k_seq), self.view(inp.v_seq)
        sdpa = self.torch.nn.functional.scaled_dot_product_attention
        try:
            with self.flash():
                sdpa(q[:, :, :64], k[:, :, :64], v[:, :, :64], is_causal=True, enable_gqa=True)
            self.how, extra = "flash, enable_gqa", dict(enable_gqa=True)
        except (TypeError, RuntimeError):
            group = nq // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            self.how, extra = "flash, K/V repeated per q head", {}

        def run():
            with self.flash():
                self.out = sdpa(q, k, v, is_causal=True, **extra)
        return run

    def time(self, run, calls: int) -> float:
        """Seconds per call: median of 5 timings of ``calls`` back-to-back calls (after two warm-up calls)."""
        torch = self.torch
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                run()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3 / calls)
        return float(np.median(times))

    def output_bits(self):
        return self.out[0].transpose(0, 1).contiguous().view(self.torch.int16).cpu().numpy().view(np.uint16)


def calls_for(T) -> int:
    """Calls a timing covers: enough that the shortest prompts still give a few hundred µs."""
    return 1 if SIM else max(1, min(20, 2 ** 26 // (T * T) + 1))


def bench_prefill(rng, rows, tokens=PREFILL_TOKENS, prefix=0, geometries=(None,), label="prefill", models=None,
                  torch=None, split_check=SPLIT_CHECK_TOKENS, quiet=False):
    """Time the tiled kernel on every shape and chunk length, at its default tile (``None`` in ``geometries``) and at
    each forced one; torch beside it when given, the split-K kernel up to ``split_check`` tokens.  One row each."""
    from numba import cuda
    for model, (nq, nkv, D) in (models or MODELS).items():
        for T in tokens:
            inp = PrefillInputs(rng, T, prefix, nq, nkv, D)
            flops = causal_flops(T, prefix, nq, D)
            check_rows = np.arange(0, T, max(1, T // 512))       # the outputs compared: 512 tokens spread over T
            outs, peer, new = {}, {}, []
            if torch is not None and not prefix:
                run = torch.prepare(inp)
                peer = dict(torch_us=torch.time(run, calls_for(T)) * 1e6, torch_how=torch.how)
                peer["torch_TFLOPs"] = flops / peer["torch_us"] / 1e6
                outs["torch"] = torch.output_bits()
            runs = [("prefill", g) for g in geometries] + ([("split", None)] if T <= split_check else [])
            for method, geometry in runs:
                out = cuda.device_array((T, nq, D), np.uint16)
                fn = inp.call(out, method, geometry, ws=inp.workspace() if method == "split" else None)
                try:
                    fn()
                except ValueError as e:          # a forced tile this shape cannot take (too much shared memory)
                    print(f"  {model:13s} T {T:6d}  tile {','.join(map(str, geometry))}: skipped ({e})", flush=True)
                    continue
                sec = time_calls([fn] * calls_for(T))
                geo = list(geometry or A.prefill_geometry(D, nq // nkv)) if method == "prefill" else None
                key = method if geometry is None else ",".join(map(str, geometry))
                outs[key] = out.copy_to_host()
                new.append(dict(kind=label, model=model, nq=nq, nkv=nkv, D=D, T=T, prefix=prefix, method=method,
                                forced=geometry is not None, geometry=geo, us=sec * 1e6, TFLOPs=flops / sec / 1e12,
                                key=key, **peer))
            for r in new:
                for peer_key, field in (("torch", "rel_l2_vs_torch"), ("split", "rel_l2_prefill_vs_split")):
                    if peer_key in outs and r["key"] != peer_key:
                        r[field] = bf16_rel_l2(outs[r["key"]], outs[peer_key], check_rows)
                if not quiet:
                    print_prefill_row(r)
            rows += new
            del inp, outs
    return rows


def print_prefill_row(r):
    geo = "split-K" if r["method"] == "split" else ("tile " if r["forced"] else "default ") + ",".join(
        map(str, r["geometry"]))
    torch = (f"  torch {r['torch_us']:9.1f} us {r['torch_TFLOPs']:6.1f} TFLOP/s  "
             f"torch/ours {r['torch_us'] / r['us']:4.2f}" if "torch_us" in r else "")
    checks = "".join(f"  {name} {r[key]:.1e}" for name, key in (("rel-L2 vs torch", "rel_l2_vs_torch"),
                                                                 ("vs split", "rel_l2_prefill_vs_split")) if key in r)
    print(f"  {r['model']:13s} T {r['T']:6d} prefix {r['prefix']:5d}  {geo:18s} {r['us']:10.1f} us "
          f"{r['TFLOPs']:6.1f} TFLOP/s{torch}{checks}", flush=True)


def sweep(rng, read_bw, rows):
    q3 = {"qwen3-4b": MODELS["qwen3-4b"]} if not SIM else MODELS
    print("\ndecode geometry sweep (warps per block, warp pairs over the head dims; min split = 16 keys per warp "
          "or pair)", flush=True)
    if SIM:
        runs = [((2, False), MODELS), ((2, True), MODELS)]
    else:
        qwen35 = {"qwen3.5-full": MODELS["qwen3.5-full"]}
        runs = [((w, False), q3) for w in (2, 4, 8)] + [((w, True), qwen35) for w in (4, 8)]
    for geometry, models in runs:         # (warps, dim_split): attention.SplitGeometry's fields
        steps = geometry[0] // (2 if geometry[1] else 1)
        bench_decode(rng, read_bw, rows, geometry=geometry, min_split_tokens=16 * steps, models=models,
                     label="sweep-g")
    print("\ndecode split sweep (default warps)", flush=True)
    for splits in ((16, 32, 64, 128, 256) if not SIM else (2, 4)):
        for min_tokens in ((32, 64, 128) if not SIM else (4,)):
            bench_decode(rng, read_bw, rows, num_splits=splits, min_split_tokens=min_tokens, models=q3,
                         contexts=CONTEXTS, label="sweep-s", quiet=True)
    best = {}
    for r in rows:
        if r["kind"] == "sweep-s" and (r["ctx"] not in best or r["us"] < best[r["ctx"]]["us"]):
            best[r["ctx"]] = r
    for r in best.values():
        print(f"  best {r['ctx']:6d}: splits {r['splits']:3d} min {r['min_split_tokens']:3d}  {r['us']:8.2f} us  "
              f"{r['GBps']:6.0f} GB/s")
    print("\nprefill tile sweep (warps, m16 tiles a warp, keys a tile, stages), 8192 tokens", flush=True)
    tiles = {128: [(4, 2, 64, 2), (4, 2, 64, 3), (8, 1, 64, 2), (8, 1, 64, 3), (4, 2, 32, 3), (8, 2, 64, 2)],
             256: [(8, 1, 64, 2), (8, 1, 32, 3), (4, 1, 64, 2), (4, 1, 32, 4)]}
    for model, (nq, nkv, D) in MODELS.items():
        if SIM:
            geos = [(1, 1, 16, 2), (1, 2, 32, 3)]
        else:
            geos = [g for g in tiles[D] if 2 * D * (16 * g[0] * g[1] + 2 * g[3] * g[2]) <= 227 * 1024]
        bench_prefill(rng, rows, tokens=(8192,) if not SIM else PREFILL_TOKENS,
                      geometries=[A.geometry(*g) for g in geos], models={model: (nq, nkv, D)}, label="sweep-p",
                      split_check=0)
    print("\nsplit vs tiled for a chunk of T tokens after a 4096-token prefix", flush=True)
    bench_prefill(rng, rows, tokens=(16, 32, 64, 128, 256, 512) if not SIM else (4, 8), prefix=4096 if not SIM else 16,
                  models=q3, label="crossover", split_check=1 << 30)
    return rows


def parse_geometry(text: str):
    """``W,M,BK,S`` -> the prefill tile (``attention.PrefillGeometry``)."""
    try:
        return A.geometry(*(int(v) for v in text.split(",")))
    except (TypeError, ValueError):
        raise SystemExit(f"error: --prefill-geometry {text!r}: expected warps,m_tiles,block_keys,stages, e.g. 4,2,64,2")


def main(argv=None) -> int:
    global A
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", choices=("decode", "prefill", "batch"),
                    help="run only the batch-1 decode, the prefill or the batched decode (--batch) part")
    ap.add_argument("--batch", type=int, default=None, help="also time a decode call of this many sequences")
    ap.add_argument("--batch-context", type=int, default=None,
                    help="keys of each sequence in the batched decode (default 256)")
    ap.add_argument("--decode-geometry", action="append", default=[], metavar="W,P[,S[,K[,B]]]",
                    help="also time the batched decode with W warps a block, in pairs over the head dims when P=1, "
                         "S splits per (token, kv head) of at least K keys each (0 or left out: the engine's), B "
                         "blocks an SM of a grid walking the (token, kv head, split) items (0 or left out: a block "
                         "per item)")
    ap.add_argument("--tokens", help="prefill chunk lengths, comma-separated (default: %s)" %
                    ",".join(map(str, PREFILL_TOKENS)))
    ap.add_argument("--prefill-geometry", action="append", default=[], metavar="W,M,BK,S",
                    help="also time this prefill tile (warps, m16 tiles a warp, keys a K/V tile, ring stages)")
    ap.add_argument("--shapes", help="head shapes, comma-separated, of the prefill (default: %s) and of the batched "
                    "decode (default: the first)" % ",".join(MODELS))
    ap.add_argument("--no-torch", action="store_true", help="skip the torch SDPA peer")
    ap.add_argument("--sweep", action="store_true", help="also sweep geometries / splits / crossover (minutes)")
    args = ap.parse_args(argv)
    A = attention_api()
    geometries = [None] + [parse_geometry(g) for g in args.prefill_geometry]
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else PREFILL_TOKENS
    t_start = time.perf_counter()
    print(pegainfer.device.describe(), flush=True)
    if SIM:
        print("smoke run: tiny shapes, wall-clock times (meaningless), no CUDA graphs, no torch", flush=True)
        read_bw = 0.0
    else:
        from pegainfer.kernels.memory import measure_read_bandwidth
        read_bw = measure_read_bandwidth(2 << 30)
        print(f"read bandwidth (16-byte loads over 2 GB): {read_bw / 1e9:.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    if args.only == "batch" and not args.batch:
        raise SystemExit("error: --only batch needs --batch B")
    shapes = args.shapes.split(",") if args.shapes else None
    if shapes and any(m not in MODELS for m in shapes):
        raise SystemExit(f"error: --shapes: choose from {', '.join(MODELS)}")
    batch_shapes = shapes or [next(iter(MODELS))]
    if args.only not in ("prefill", "batch"):
        print(f"\ndecode, batch 1 (split-K, combine fused; bytes = K + V of the context; page {PAGE}, "
              f"max_model_len {MAX_MODEL_LEN})", flush=True)
        bench_decode(rng, read_bw, rows)
    if args.batch and args.only in (None, "batch"):
        ctx = args.batch_context or (256 if not SIM else 9)
        print(f"\ndecode, batch {args.batch} at {ctx} keys each (split-K; bytes = K + V of every sequence)",
              flush=True)
        for model in batch_shapes:
            bench_batch_decode(rng, read_bw, rows, args.batch, ctx,
                               [None] + [parse_decode_geometry(g) for g in args.decode_geometry], model=model)
    if args.only not in ("decode", "batch"):
        torch = None if SIM or args.no_torch else TorchSDPA()
        print(f"\nprefill, one prompt of T tokens (causal TFLOP/s = 4·T²/2·D·nq / time; tile = warps, m16 tiles "
              f"a warp, keys a tile, stages){'; peer: torch SDPA' if torch else ''}", flush=True)
        bench_prefill(rng, rows, tokens=tokens, geometries=geometries, torch=torch,
                      models={m: MODELS[m] for m in shapes or MODELS})
        if torch is not None and torch.how:
            print(f"  (torch SDPA: {torch.how})", flush=True)
    if args.sweep:
        sweep(rng, read_bw, rows)
    result = dict(device=pegainfer.device.describe(), read_bw_GBps=read_bw / 1e9, page_size=PAGE,
                  max_model_len=MAX_MODEL_LEN, rows=rows, seconds=time.perf_counter() - t_start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.json}")
    print(f"done in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
