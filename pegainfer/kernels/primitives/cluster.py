"""Thread block clusters (sm_90): blocks launched in groups that run at once on one GPC, see each other's shared
memory, and share TMA copies.

``cluster_rank()`` is the block's rank in its cluster, ``cluster_size()`` the cluster's blocks, ``cluster_index()``
/ ``cluster_count()`` the cluster's index in the grid and the clusters of the launch (1-D).  ``cluster_sync()``: every
thread of every block of the cluster arrives and waits (release / acquire at cluster scope; a block must not exit
while another may still write its shared memory or arrive on its mbarriers, and no block may copy into another's
shared memory before that block's mbarriers are initialized).  ``mbar_arrive_in(bars, b, rank)``: one arrival on
the mbarrier at ``bars[b]`` of block ``rank`` of the cluster (the same offset in its shared memory; the default
release at CTA scope, as CUTLASS's ``ClusterBarrier::arrive``: ``.release.cluster`` compiles to a GPU-wide
``MEMBAR`` before every arrival, which in a GEMM's K loop stalls the consumers each stage).
``tma_load_2d_multicast(..., bars, b, mask)``: ``tma.tma_load_2d`` into the same shared-memory offset of every
block of the cluster whose bit is set in ``mask``, each copy counting its bytes on that block's mbarrier at
``bars[b]``.  A launch gives the cluster shape (``launch(..., cluster=2)``).

In the simulator blocks run one after another, so a cluster is one block: rank 0 of size 1, ``cluster_sync``
nothing, an arrival in "another" block one in this block, a multicast a plain copy into this block (its mask
must hold bit 0).  A kernel written against ``cluster_size()`` then runs its one-block form there.
"""
from __future__ import annotations

from pegainfer.device import SIMULATOR

if SIMULATOR:
    from numba import cuda
    import numpy as np

    from pegainfer.kernels.primitives.barriers import mbar_arrive
    from pegainfer.kernels.primitives.launch_shape import device_fn
    from pegainfer.kernels.primitives.tma import tma_load_2d

    @device_fn
    def cluster_rank():
        return np.uint32(0)

    @device_fn
    def cluster_size():
        return np.uint32(1)

    @device_fn
    def cluster_index():
        return np.uint32(cuda.blockIdx.x)

    @device_fn
    def cluster_count():
        return np.uint32(cuda.gridDim.x)

    @device_fn
    def cluster_sync():
        """Nothing to wait for in a one-block cluster (and a block barrier here would meet the emulated warpgroup
        instructions' barriers, which only the consumer threads take)."""

    @device_fn
    def mbar_arrive_in(bars, b, rank):
        if int(rank) != 0:
            raise IndexError(f"mbar_arrive_in: block {int(rank)} of a one-block cluster")
        mbar_arrive(bars, b)

    @device_fn
    def tma_load_2d_multicast(smem, dst, table, slot, src32, row0, k0, n_rows, k, box_rows, bars, b, mask):
        if not int(mask) & 1:
            raise ValueError(f"tma_load_2d_multicast: mask {int(mask):#x} leaves out the one block of the cluster")
        tma_load_2d(smem, dst, table, slot, src32, row0, k0, n_rows, k, box_rows, bars, b)
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from pegainfer.kernels.primitives.ptx import _asm_statement, _element_pointer, _to_shared
    from pegainfer.kernels.primitives.tma import BOX_COPY, box_copy_operands

    def _special_register(register: str):
        @intrinsic
        def read(typingctx):
            sig = types.uint32()

            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), []), f"mov.u32 $0, {register};", "=r")
                return builder.call(asm, [])

            return sig, codegen
        return read

    cluster_rank = _special_register("%cluster_ctarank")
    cluster_size = _special_register("%cluster_nctarank")
    cluster_index = _special_register("%clusterid.x")
    cluster_count = _special_register("%nclusterid.x")
    # not ``.aligned``: a warp may arrive diverged (the producer warp, whose one thread copies while the rest wait)
    cluster_sync = _asm_statement("barrier.cluster.arrive.release; barrier.cluster.wait.acquire;")

    @intrinsic
    def mbar_arrive_in(typingctx, bars, b, rank):
        """``mapa`` the mbarrier's address into block ``rank``'s shared memory, then ``mbarrier.arrive`` there (what
        the arriving thread read before, its stage, is done: a ``wgmma`` wait; it wrote nothing the other block
        reads, so no cluster-scope fence)."""
        sig = types.void(bars, b, rank)

        def codegen(context, builder, sig, args):
            bp = _element_pointer(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            r = context.cast(builder, args[2], sig.args[2], types.uint32)
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [bp.type, ir.IntType(32)]),
                "{ " + _to_shared("$0", "sb") + " .reg .u32 rb; mapa.shared::cluster.u32 rb, sb, $1;"
                " mbarrier.arrive.shared::cluster.b64 _, [rb]; }",
                "l,r,~{memory}", side_effect=True)
            builder.call(asm, [bp, r])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def tma_load_2d_multicast(typingctx, smem, dst, table, slot, src32, row0, k0, n_rows, k, box_rows, bars, b,
                              mask):
        """``cp.async.bulk.tensor.2d ... .multicast::cluster`` of one box to the blocks of ``mask``."""
        sig = types.void(smem, dst, table, slot, src32, row0, k0, n_rows, k, box_rows, bars, b, mask)

        def codegen(context, builder, sig, args):
            ops = box_copy_operands(context, builder, sig, args)
            ops.append(builder.trunc(context.cast(builder, args[12], sig.args[12], types.uint32), ir.IntType(16)))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [o.type for o in ops]),
                               BOX_COPY + ".multicast::cluster [db], [$1, {$2, $3}], [bb], $5; }",
                               "l,l,r,r,l,h,~{memory}", side_effect=True)
            builder.call(asm, ops)
            return context.get_dummy_value()

        return sig, codegen
