"""tools/sass_audit.py's PTX preparation (the assembling itself needs ptxas, which CI does not have)."""
from tools.sass_audit import assemblable

SNAPSHOT_PTX = """// target options [('debug', 0), ('launch_bounds', (256, 2)), ('opt', True)]
.version 9.5
.target sm_90
.address_size 64

.common .global .align 8 .u64 SYM?;
.common .global .align 8 .u64 SYM?;
.visible .entry SYM0(
\t.param .u64 SYM0_param_0
)
{
\tret;
}
"""


def test_snapshot_ptx_becomes_assemblable_for_sm_90a():
    """The anonymized symbols get distinct names, the launch bounds of the target-options line go on the entry,
    and the ISA and target are ptxas 12+'s for sm_90a."""
    out = assemblable(SNAPSHOT_PTX)
    assert "SYM?" not in out and "SYMQ0;" in out and "SYMQ1;" in out
    assert ".version 8.5\n.target sm_90a\n" in out
    assert "SYM0_param_0\n)\n.maxntid 256, 1, 1\n.minnctapersm 2\n{" in out


def test_a_kernel_without_launch_bounds_gets_none():
    out = assemblable(SNAPSHOT_PTX.replace("('launch_bounds', (256, 2)), ", ""))
    assert ".maxntid" not in out and ".minnctapersm" not in out
