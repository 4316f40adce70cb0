"""Cost model: hand-computed charges, admission and projection, plus split-safety properties."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capacity.errors import PricingError
from capacity.formats import KVFormat
from capacity.pricing import CostModel, Projection, Workspace

# budget 10,000 B; 10 B/token; 16-token pages; 50 B fixed per request;
# workspace: 1,000 B arena + 2 B/token + 100 B/request; ceiling 4. Free when idle: 9,000 B.
CM = CostModel(budget_bytes=10_000, bytes_per_token=10, page_tokens=16, fixed_bytes_per_request=50,
               workspace=Workspace(fixed=1000, per_token=2, per_request=100), concurrency_ceiling=4)


def test_workspace_is_linear():
    assert Workspace(fixed=7, per_token=3, per_request=5).bytes(10, 2) == 7 + 30 + 10
    assert Workspace().bytes(123, 4) == 0


def test_request_bytes_charges_whole_pages():
    assert CM.request_bytes(0) == 50
    assert CM.request_bytes(1) == 160 + 50        # a 1-token request pays a whole page
    assert CM.request_bytes(16) == 160 + 50
    assert CM.request_bytes(17) == 320 + 50       # the 17th token opens a second page


def test_charge_includes_per_request_workspace():
    assert CM.charge_bytes(17) == 370 + 2 * 17 + 100
    assert CM.free_bytes(0) == 9000                # arena subtracted once, not per request
    assert CM.free_bytes(9500) == 0


def test_fits_at_the_byte_edge_and_the_ceiling():
    assert CM.charge_bytes(1) == 312
    assert CM.fits(used_bytes=8688, raw_tokens=1, running=1)       # 9000 - 8688 = 312 exactly
    assert not CM.fits(used_bytes=8689, raw_tokens=1, running=1)
    assert not CM.fits(used_bytes=0, raw_tokens=1, running=4)      # ceiling reached


def test_max_raw_tokens_hand_computed():
    # 46 pages: 7360 + 50 + 2*736 + 100 = 8982 <= 9000; 737 tokens need 47 pages: 9144 > 9000.
    assert CM.max_raw_tokens() == 736
    assert CM.fits(0, 736, 0) and not CM.fits(0, 737, 0)
    assert CM.max_raw_tokens(running=4) == 0
    assert CM.max_raw_tokens(used_bytes=9000) == 0


def test_max_concurrency_hand_computed():
    assert CM.charge_bytes(100) == 7 * 160 + 50 + 200 + 100 == 1470
    assert CM.max_concurrency(100) == 4            # 6 fit by bytes, the ceiling says 4
    assert CM.charge_bytes(600) == 38 * 160 + 50 + 1200 + 100 == 7430
    assert CM.max_concurrency(600) == 1
    assert CM.max_concurrency(100, used_bytes=6000, running=1) == 2   # 3000 // 1470


def test_aggregate_bytes_is_the_worst_split():
    # 40 tokens over <= 2 requests: worst pages = 2 + 38 // 16 = 4 (e.g. 1 + 39 -> 1 + 3 pages)
    assert CM.aggregate_bytes(40, 2) == 4 * 160 + 2 * 150 + 80
    assert CM.aggregate_bytes(3, 8) == 3 * 160 + 8 * 150 + 6  # fewer tokens than requests
    assert CM.aggregate_bytes(40, 1) == CM.charge_bytes(40)


def test_project_hand_computed():
    # count 4: 1248 + 192 q + 2 r <= 9000 with T = 4 + 16 q + r -> q = 40, r = 15 -> T = 659
    assert CM.project() == Projection(659, 4)
    assert CM.aggregate_bytes(659, 4) <= 9000 < CM.aggregate_bytes(660, 4)
    # 4 requests of >= 200 tokens cannot fit; 3 can: 936 + 192 q + 2 r <= 9000 -> T = 675
    assert CM.project(min_request_tokens=200) == Projection(675, 3)
    assert CM.project(running=3) == Projection(CM.max_raw_tokens(running=3), 1)
    assert CM.project(used_bytes=9000) == Projection(0, 0)


def test_overheads_lower_the_advertised_max_not_used():
    bare = CostModel(budget_bytes=10_000, bytes_per_token=10, page_tokens=1,
                     fixed_bytes_per_request=0, concurrency_ceiling=4)
    assert bare.max_raw_tokens() == 1000
    assert CM.max_raw_tokens() < bare.max_raw_tokens()


def test_packed_format_bytes_from_formats_module():
    # Qwen3.6-35B-A3B full attention: 10 layers x 2 KV heads x 256, INT4 -> 6,400 B/token (reference).
    bpt = 10 * KVFormat("int4", 256, "bfloat16").bytes_per_token(2)
    assert bpt == 6400
    cm = CostModel(budget_bytes=1 << 30, bytes_per_token=bpt, page_tokens=16,
                   fixed_bytes_per_request=0)
    assert cm.request_bytes(32768) == 209_715_200
    assert cm.request_bytes(1) == 16 * 6400


def test_token_limit_caps_one_request():
    cm = CostModel(budget_bytes=10**12, bytes_per_token=0, page_tokens=16,
                   fixed_bytes_per_request=0, concurrency_ceiling=2, token_limit=4096)
    assert cm.max_raw_tokens() == 4096
    assert not cm.fits(0, 4097, 0)
    assert cm.project() == Projection(8192, 2)


@pytest.mark.parametrize("kwargs", [
    dict(budget_bytes=-1), dict(page_tokens=0), dict(concurrency_ceiling=0),
    dict(bytes_per_token=1.5), dict(fixed_bytes_per_request=True)])
def test_invalid_cost_models_are_refused(kwargs):
    base = dict(budget_bytes=100, bytes_per_token=1, page_tokens=16, fixed_bytes_per_request=0)
    with pytest.raises(PricingError):
        CostModel(**{**base, **kwargs})


def test_wire_round_trip():
    assert CostModel.from_dict(CM.to_dict()) == CM


cost_models = st.builds(
    CostModel, budget_bytes=st.integers(0, 200_000), bytes_per_token=st.integers(0, 64),
    page_tokens=st.integers(1, 32), fixed_bytes_per_request=st.integers(0, 500),
    workspace=st.builds(Workspace, fixed=st.integers(0, 5000), per_token=st.integers(0, 8),
                        per_request=st.integers(0, 300)),
    concurrency_ceiling=st.integers(1, 6), token_limit=st.integers(1, 5000))


@settings(max_examples=200, deadline=None)
@given(cm=cost_models, data=st.data())
def test_any_split_of_the_projection_is_admitted(cm, data):
    proj = cm.project()
    if proj.max_new_requests == 0:
        return
    n = data.draw(st.integers(1, proj.max_new_requests))
    cuts = sorted(data.draw(st.lists(st.integers(0, proj.max_new_raw_tokens), min_size=n - 1,
                                     max_size=n - 1)))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [proj.max_new_raw_tokens])]
    if max(sizes) > cm.token_limit:
        return  # a split the per-request limit forbids anyway
    used = 0
    for running, size in enumerate(sizes):
        assert cm.fits(used, size, running)
        used += cm.charge_bytes(size)


@settings(max_examples=200, deadline=None)
@given(cm=cost_models, used=st.integers(0, 200_000), running=st.integers(0, 6))
def test_max_raw_tokens_is_the_admission_edge(cm, used, running):
    t = cm.max_raw_tokens(used, running)
    if t:
        assert cm.fits(used, t, running)
    if t < cm.token_limit:
        assert not cm.fits(used, t + 1, running)
