"""The TMA primitives (``primitives.tma``): a tensor-map copy lands a box in the 128-byte-swizzled layout
``primitives.wgmma`` documents, with zeros for rows and K past the array's end, and its mbarrier completes only once
every announced byte has landed; a producer thread and consumer warps pass a two-stage ring around through full and
empty barriers over several phases.  In the simulator this checks the twins; on a GPU, the instructions."""
import numpy as np
import pytest
from numba import cuda
from numba import types as nbtypes

from pegainfer.device import SIMULATOR
from pegainfer.kernels.launch import launch
from pegainfer.kernels.primitives import as_words, kernel, uint32
from pegainfer.kernels.primitives import cuda as kcuda
from pegainfer.kernels.primitives.barriers import (mbar_arrive, mbar_arrive_expect_tx, mbar_fence_init, mbar_init,
                                                   mbar_wait, named_barrier)
from pegainfer.kernels.primitives.tma import tensor_map, tma_load_2d
from pegainfer.kernels.primitives.wgmma import shared_address

BOX = 16          # rows of a box
TILE_WORDS = BOX * 32


@kernel
def copy_box(a32, maps, slot, n_rows, k, row0, k0, out):
    """Thread 0 copies the box at (row0, k0) into a 1024-byte-aligned tile; every thread then copies the tile's
    words to ``out`` (as they lie in shared memory: swizzled)."""
    smem = kcuda.shared.array(0, nbtypes.uint32)
    base = ((uint32(1024) - (shared_address(smem, 0) & uint32(1023))) & uint32(1023)) >> uint32(2)
    bar = base + uint32(TILE_WORDS)
    tid = kcuda.threadIdx.x
    if tid == 0:
        mbar_init(smem, bar, 1)
        mbar_fence_init()
    kcuda.syncthreads()
    if tid == 0:
        mbar_arrive_expect_tx(smem, bar, 128 * BOX)
        tma_load_2d(smem, base, maps, slot, a32, row0, k0, n_rows, k, BOX, smem, bar)
    mbar_wait(smem, bar, 0)
    for i in range(tid, TILE_WORDS, kcuda.blockDim.x):
        out[i] = smem[base + uint32(i)]


def swizzled_box(a, row0, k0):
    """The words a box of ``a`` (uint16 [rows, K]) at (row0, k0) leaves in a swizzled tile, zeros outside ``a``."""
    rows, k = a.shape
    box = np.zeros((BOX, 64), np.uint16)
    r = a[row0:row0 + BOX, k0:k0 + 64]
    box[:r.shape[0], :r.shape[1]] = r
    words = box.view(np.uint32).reshape(BOX, 8, 4)          # [row, chunk, word]
    tile = np.zeros((BOX, 8, 4), np.uint32)
    for row in range(BOX):
        for c in range(8):
            tile[row, c ^ (row & 7)] = words[row, c]
    return tile.reshape(-1)


def test_tensor_map_box_lands_swizzled_with_zero_fill(rng):
    """A box across the array's last rows and its last K: the rows and K beyond are zeros, the rest in place."""
    rows, k = 40, 200                      # row0 32: 8 rows past the end; k0 192: 56 of 64 K past the end
    a = rng.integers(0, 1 << 16, (rows, k), dtype=np.uint16)
    d = cuda.to_device(a)
    maps, slot = tensor_map(d, BOX)
    for row0, k0 in ((0, 0), (8, 64), (32, 192)):
        out = cuda.to_device(np.zeros(TILE_WORDS, np.uint32))
        launch(copy_box, 1, 64, as_words(d), maps, slot, rows, k, row0, k0, out, shared=1024 + 4 * TILE_WORDS + 16)
        np.testing.assert_array_equal(out.copy_to_host(), swizzled_box(a, row0, k0), err_msg=f"box {row0}, {k0}")


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="tensor maps and graphs are the GPU's")
def test_a_map_first_met_inside_a_capture_stays_out_of_the_graph(rng):
    """Catches a tensor map whose slot is written by a copy on the capturing stream: the copy becomes a node of
    the graph and runs at every replay.  The map of an array first met inside a capture (as the engine captures:
    relaxed mode) is written at once; the graph holds the kernel only, and its replay copies the right box."""
    from cuda.bindings import driver as drv
    from pegainfer.kernels.launch import on_stream
    rows, k = 32, 128
    a = rng.integers(0, 1 << 16, (rows, k), dtype=np.uint16)
    d = cuda.to_device(a)
    out = cuda.to_device(np.zeros(TILE_WORDS, np.uint32))
    stream = cuda.stream()
    s = drv.CUstream(int(stream.handle))
    with on_stream(stream):
        assert drv.cuStreamBeginCapture(s, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)[0] == 0
        try:
            maps, slot = tensor_map(d, BOX)                  # first met here
            launch(copy_box, 1, 64, as_words(d), maps, slot, rows, k, 16, 64, out,
                   shared=1024 + 4 * TILE_WORDS + 16)
        finally:
            err, graph = drv.cuStreamEndCapture(s)
    assert err == 0, err
    err, nodes, n = drv.cuGraphGetNodes(graph, 16)
    kinds = [drv.cuGraphNodeGetType(node)[1] for node in nodes[:n]]
    assert kinds == [drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL], kinds
    err, exe = drv.cuGraphInstantiate(graph, 0)
    assert err == 0, err
    assert drv.cuGraphLaunch(exe, s)[0] == 0
    stream.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), swizzled_box(a, 16, 64))


@kernel
def ring_sum(a32, maps, slot, n_rows, k, stages, out):
    """A producer thread (thread 64) streams ``n_rows / BOX`` boxes (K 0 .. 64) through a ring of ``stages`` tiles;
    two consumer warps fold each box's words into ``out[box]`` by XOR, releasing the stage after."""
    smem = kcuda.shared.array(0, nbtypes.uint32)
    base = ((uint32(1024) - (shared_address(smem, 0) & uint32(1023))) & uint32(1023)) >> uint32(2)
    full = base + uint32(stages * TILE_WORDS)
    empty = full + uint32(2 * stages)
    tid = kcuda.threadIdx.x
    if tid == 64:
        for s in range(stages):
            mbar_init(smem, full + uint32(2 * s), 1)
            mbar_init(smem, empty + uint32(2 * s), 64)
        mbar_fence_init()
    kcuda.syncthreads()
    n_boxes = n_rows // BOX
    if tid == 64:
        for i in range(n_boxes):
            s = uint32(i % stages)
            mbar_wait(smem, empty + uint32(2) * s, uint32(((i // stages) & 1) ^ 1))
            mbar_arrive_expect_tx(smem, full + uint32(2) * s, 128 * BOX)
            tma_load_2d(smem, base + s * uint32(TILE_WORDS), maps, slot, a32, i * BOX, 0, n_rows, k, BOX, smem,
                        full + uint32(2) * s)
    if tid < 64:
        for i in range(n_boxes):
            s = uint32(i % stages)
            mbar_wait(smem, full + uint32(2) * s, uint32((i // stages) & 1))
            part = uint32(0)
            for j in range(tid, TILE_WORDS, 64):
                part ^= smem[base + s * uint32(TILE_WORDS) + uint32(j)]
            kcuda.atomic.xor(out, i, part)
            named_barrier(1, 64)                   # every consumer read the stage (and the atomics are issued)
            mbar_arrive(smem, empty + uint32(2) * s)


def test_ring_of_full_and_empty_barriers_over_several_phases(rng):
    """Eight boxes through two stages (four rounds of each barrier): every box folded exactly once, from its own stage."""
    rows, k, stages = 8 * BOX, 64, 2
    a = rng.integers(0, 1 << 16, (rows, k), dtype=np.uint16)
    d = cuda.to_device(a)
    maps, slot = tensor_map(d, BOX)
    out = cuda.to_device(np.zeros(8, np.uint32))
    launch(ring_sum, 1, 96, as_words(d), maps, slot, rows, k, stages, out,
           shared=1024 + 4 * stages * TILE_WORDS + 32 * stages)
    want = np.bitwise_xor.reduce(a.view(np.uint32).reshape(8, -1), axis=1)
    np.testing.assert_array_equal(out.copy_to_host(), want)
