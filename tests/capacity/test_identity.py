"""Execution identity grammar and quarantine."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from capacity.errors import IdentityError
from capacity.formats import KVFormat
from capacity.identity import (INVALID, NATIVE, ExecutionKey, execution_identity, parse_execution)

INT4 = "kvq-v1:affine-v1-k4v4-g64-f32-h128-s1:prefill=direct"


def test_wire_form_from_format_identity():
    fmt = KVFormat("int4", 128)
    assert execution_identity(fmt.identity) == INT4
    assert execution_identity(fmt.identity, "fused").endswith(":prefill=fused")
    assert execution_identity(KVFormat("native", 128).identity) == NATIVE   # native omits it


def test_producer_errors_raise():
    with pytest.raises(IdentityError):
        execution_identity("affine-v1-k3v4-g64-f32-h128-s1")
    with pytest.raises(IdentityError):
        execution_identity(KVFormat("int8", 64).identity, "opportunistic")


@pytest.mark.parametrize("value", [None, ""])
def test_absent_means_native(value):
    assert parse_execution(value) == NATIVE


def test_valid_packed_identities_pass_through():
    assert parse_execution(INT4) == INT4
    k8v4 = "kvq-v1:affine-v1-k8v4-g64-f32-h64-s1:prefill=fused"
    assert parse_execution(k8v4) == k8v4


@pytest.mark.parametrize("value", [
    "kvq-v1:affine-v1-k4v4-g32-f32-h128-s1:prefill=direct",   # group not allowed
    "kvq-v1:affine-v1-k2v4-g64-f32-h128-s1:prefill=direct",   # bits not allowed
    "kvq-v1:affine-v1-k4v4-g64-f32-h256-s1:prefill=direct",   # rotation not allowed
    "kvq-v1:affine-v1-k4v4-g64-f32-h128-s2:prefill=direct",   # seed not allowed
    "kvq-v1:affine-v1-k4v4-g64-f32-h128-s1:prefill=opportunisticSDPA",
    "kvq-v2:affine-v1-k4v4-g64-f32-h128-s1:prefill=direct",
    "kvq-v1:native-v1-f32:prefill=direct",                     # native must omit the field
    "affine-v1-k4v4-g64-f32-h128-s1",                          # bare format identity
    INT4 + " ", "INT4", "kvq-v1:invalid", "x" * 10_000, 42])
def test_malformed_values_are_quarantined_not_native(value):
    assert parse_execution(value) == INVALID


def test_key_classification():
    q = ExecutionKey.make("m", "M4|Max", INT4)
    assert q.is_quantized and not q.is_native
    bad = ExecutionKey.make("m", "M4|Max", "garbage")
    assert bad.is_invalid and not bad.is_native and not bad.is_quantized
    n = ExecutionKey.make("m", None, None)
    assert n.is_native and n.chip_class == "unknown"
    assert q.model_level() == ExecutionKey("m", "", INT4)
    with pytest.raises(IdentityError):
        ExecutionKey.make("m", "M4 Max; drop", None)
    with pytest.raises(IdentityError):
        ExecutionKey.make("", "M4", None)


@given(st.text(min_size=1, max_size=200))
def test_no_nonempty_value_ever_parses_as_native(value):
    out = parse_execution(value)
    assert out != NATIVE
    assert out == INVALID or out == value   # valid values pass through unchanged


@given(st.sampled_from(["int8", "k8v4", "int4"]), st.sampled_from([64, 128, 256]),
       st.sampled_from(["direct", "fused"]))
def test_every_produced_identity_parses_back(name, head_dim, prefill):
    wire = execution_identity(KVFormat(name, head_dim).identity, prefill)
    assert parse_execution(wire) == wire
