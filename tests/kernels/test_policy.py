"""``LaunchPolicy``: the one object that says how kernels launch (``pegainfer/kernels/policy.py``)."""
import dataclasses
import json

import pytest

from pegainfer.errors import PegainferError
from pegainfer.kernels.policy import DEFAULT_POLICY, PDL_DEFAULT, LaunchPolicy, load_tuning


def test_overlaps_follows_the_pdl_set():
    """Catches a launch that overlaps without being named in the policy (or one that is named but never does)."""
    assert DEFAULT_POLICY.overlaps("gemv") and DEFAULT_POLICY.overlaps("paged_decode_attention")
    assert not DEFAULT_POLICY.overlaps("sample") and not DEFAULT_POLICY.overlaps(None)
    assert LaunchPolicy(pdl=None).overlaps("sample")
    assert not LaunchPolicy(pdl=frozenset()).overlaps("gemv")
    assert LaunchPolicy.from_options(pdl=False).pdl == frozenset()
    assert LaunchPolicy.from_options().pdl == PDL_DEFAULT


def test_residual_ready_reasons_from_the_fixed_release_points():
    """Catches a policy that lets a prompt chunk's gate/up read the residual before its writer has completed (its
    attention kernels release at their start), or that rejects the cases the decode graph relies on."""
    assert DEFAULT_POLICY.residual_ready("down", decode=False) and DEFAULT_POLICY.residual_ready("down", decode=True)
    assert DEFAULT_POLICY.residual_ready("mixer", decode=True)
    assert not DEFAULT_POLICY.residual_ready("mixer", decode=False)
    with pytest.raises(ValueError, match="down' or 'mixer"):
        DEFAULT_POLICY.residual_ready("attention", decode=True)


def test_policy_is_frozen_and_variants_are_replacements():
    """Catches a policy that can be changed under a model that holds it."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_POLICY.preload_o = False
    variant = dataclasses.replace(DEFAULT_POLICY, preload_o=False)
    assert DEFAULT_POLICY.preload_o and not variant.preload_o


def test_tuning_file_entries_reach_the_policy(tmp_path):
    """Catches a tuning file whose GEMV and skinny entries are read under the wrong key or kind."""
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps([
        {"n_cols": 6144, "k": 2560, "max_tokens": 1, "gated": False,
         "geometry": {"rows_per_warp": 2, "warps": 8, "k_split": 1, "max_tokens": 1, "stages": 6}},
        {"n_cols": 19456, "k": 2560, "m_tiles": 1, "gated": True, "geometry": {"warps": 4, "n_tiles": 2}},
        {"kind": "wgmma", "n_cols": 2560, "k": 4096, "tokens": 64, "gated": False,
         "geometry": {"warpgroups": 1, "bn": 128, "stages": 6, "k_splits": 8, "fill": "tma"}}]))
    policy = LaunchPolicy.from_options(tuning_file=str(path))
    assert policy.tuned("gemv") == {(6144, 2560, 1, False): {"k_split": 1, "max_tokens": 1, "rows_per_warp": 2,
                                                             "stages": 6, "warps": 8}}
    assert policy.tuned("skinny") == {(19456, 2560, 1, True): {"n_tiles": 2, "warps": 4}}
    from pegainfer.kernels.linear.geometry import WgmmaGeometry, wgmma_geometry
    for tokens in (33, 64):                       # keyed by the token tile: 33..64 tokens share the entry
        assert wgmma_geometry(2560, 4096, tokens, False, policy) == WgmmaGeometry(1, 128, 6, 8, fill="tma")
    assert wgmma_geometry(2560, 4096, 65, False, policy) == wgmma_geometry(2560, 4096, 65, False)


def test_the_command_lines_tuning_file_reaches_the_engines_policy(tmp_path, monkeypatch):
    """Catches a tuning file that only an environment variable could bring in: ``--launch-policy tuning=FILE`` is
    the one way, and an environment variable of the old name changes nothing."""
    from pegainfer import argtypes
    from pegainfer.engine.engine import engine_policy
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps([{"kind": "wgmma", "n_cols": 2560, "k": 4096, "tokens": 64, "gated": False,
                                 "geometry": {"warpgroups": 1, "bn": 128, "stages": 6, "k_splits": 8}}]))
    policy = engine_policy(argtypes.launch_policy(f"tuning={path},preload_o=false"))
    assert set(policy.tuned("wgmma")) == {(2560, 4096, 64, False)} and not policy.preload_o
    monkeypatch.setenv("PEGAINFER_GEMV_TUNING", str(path))
    assert engine_policy() == DEFAULT_POLICY


@pytest.mark.parametrize("text", ["not json", "[{\"n_cols\": 1}]", "{\"a\": 1}",
                                  "[{\"kind\": \"gemm\", \"n_cols\": 1, \"k\": 1, \"tokens\": 1, \"gated\": false}]"])
def test_a_bad_tuning_file_is_one_line_naming_the_file(tmp_path, text):
    """Catches a traceback (or a silent default) for a tuning file a user got wrong."""
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PegainferError, match="bad.json") as err:
        load_tuning(str(path))
    assert "\n" not in str(err.value)
    with pytest.raises(PegainferError, match="tuning file"):
        load_tuning(str(tmp_path / "missing.json"))
