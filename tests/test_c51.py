"""The C51 projection against a loop over atoms written from the paper's Algorithm 1."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.algos.distributional import project_distribution

torch.set_num_threads(1)


def reference_projection(next_probs, returns, discounts, v_min, v_max):
    """Bellemare et al. (2017), Algorithm 1, one sample and one atom at a time.

    Where b_j is an integer (l = u) the paper's two weights (u - b_j) and (b_j - l) are
    both 0; the whole mass then belongs to atom l, as every implementation fixes it.
    """
    N, K = next_probs.shape
    dz = (v_max - v_min) / (K - 1)
    z = v_min + dz * np.arange(K)
    m = np.zeros((N, K))
    for i in range(N):
        for j in range(K):
            tz = min(v_max, max(v_min, returns[i] + discounts[i] * z[j]))
            b = min((tz - v_min) / dz, K - 1)  # at v_max, rounding can give K - 1 + 1e-15
            l, u = int(np.floor(b)), int(np.ceil(b))
            if l == u:
                m[i, l] += next_probs[i, j]
            else:
                m[i, l] += next_probs[i, j] * (u - b)
                m[i, u] += next_probs[i, j] * (b - l)
    return m


def project(next_probs, returns, discounts, v_min, v_max):
    K = next_probs.shape[1]
    support = torch.linspace(v_min, v_max, K, dtype=torch.float64)
    out = project_distribution(
        torch.as_tensor(next_probs), torch.as_tensor(returns), torch.as_tensor(discounts), support
    )
    return out.numpy()


@settings(max_examples=60, deadline=None)
@given(
    N=st.integers(1, 6),
    K=st.integers(2, 21),
    v_min=st.floats(-20, 5),
    width=st.floats(0.5, 40),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_the_loop_reference(N, K, v_min, width, seed):
    rng = np.random.default_rng(seed)
    v_max = v_min + width
    next_probs = rng.dirichlet(np.ones(K), size=N)
    # returns reach beyond both ends of the support; discounts include 0 (terminations) and 1.
    returns = rng.uniform(v_min - width, v_max + width, size=N)
    discounts = rng.choice([0.0, 0.5, 0.9, 0.99, 1.0], size=N)
    got = project(next_probs, returns, discounts, v_min, v_max)
    want = reference_projection(next_probs, returns, discounts, v_min, v_max)
    np.testing.assert_allclose(got, want, atol=1e-10)
    np.testing.assert_allclose(got.sum(1), 1.0, atol=1e-10)
    assert (got >= 0).all()


def test_integer_positions_keep_all_mass():
    # v_min=0, v_max=10, 11 atoms (dz=1), r=2, discount 1: every atom shifts by exactly 2
    # (b integer everywhere), the top two collapse onto v_max by clipping.
    next_probs = np.full((1, 11), 1 / 11)
    got = project(next_probs, np.array([2.0]), np.array([1.0]), 0.0, 10.0)
    want = np.zeros((1, 11))
    want[0, 2:10] = 1 / 11
    want[0, 10] = 3 / 11
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_point_mass_lands_where_expected():
    # Point mass at z=4 (of 0..10, dz=1); r=1, discount 0.5 -> 3.0: all on atom 3.
    next_probs = np.zeros((3, 11))
    next_probs[:, 4] = 1.0
    got = project(next_probs, np.array([1.0, 1.5, 100.0]), np.array([0.5, 0.5, 0.9]), 0.0, 10.0)
    np.testing.assert_allclose(got[0], np.eye(11)[3], atol=1e-12)
    # r=1.5 -> 3.5: split evenly between atoms 3 and 4.
    np.testing.assert_allclose(got[1], 0.5 * (np.eye(11)[3] + np.eye(11)[4]), atol=1e-12)
    # far above v_max: all on the top atom.
    np.testing.assert_allclose(got[2], np.eye(11)[10], atol=1e-12)


def test_terminal_transition_is_a_point_mass_at_the_clipped_reward():
    # discount 0: Z' is ignored, the target is the reward alone, split between neighbours.
    rng = np.random.default_rng(0)
    next_probs = rng.dirichlet(np.ones(5), size=2)
    got = project(next_probs, np.array([-0.5, -7.0]), np.array([0.0, 0.0]), -2.0, 2.0)  # dz = 1
    np.testing.assert_allclose(got[0], [0, 0.5, 0.5, 0, 0], atol=1e-12)
    np.testing.assert_allclose(got[1], [1, 0, 0, 0, 0], atol=1e-12)


def test_float32_top_atom_does_not_leak_out_of_range():
    # float32 rounding can put b a hair above K - 1; the mass must stay on the top atom.
    support = torch.linspace(-10.0, 10.0, 51)
    probs = torch.full((4, 51), 1 / 51)
    returns, discounts = torch.tensor([10.0, 9.99, 30.0, 0.3]), torch.tensor([1.0, 1.0, 0.99, 0.99])
    got = project_distribution(probs, returns, discounts, support)
    assert got.shape == (4, 51)
    np.testing.assert_allclose(got.sum(1).numpy(), 1.0, atol=1e-5)
    np.testing.assert_allclose(got[2, -1].item(), 1.0, atol=1e-6)
