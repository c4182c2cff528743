"""The counter-based hash: reference and Triton agree bit for bit, and the bits are usable."""

import copy

import pytest
import torch

import fusedopt
from fusedopt import rng
from fusedopt.kernels.hashing import launch_uniform_bits

CASES = [(0, 0, rng.STREAM_PARAM, 1), (123456789, 7, rng.STREAM_SHARED, 3), (2**40 + 5, 2**31 + 5, 17, 1_000_000)]


@pytest.mark.parametrize("seed,index,stream,step", CASES)
@pytest.mark.parametrize("numel", [1, 1023, 3001])
def test_triton_hash_matches_reference_bit_for_bit(device, seed, index, stream, step, numel):
    key = rng.host_key(seed, index, stream)
    step_t = torch.tensor(float(step), device=device)
    ref = rng.uniform_bits(key, step_t, torch.Size([numel]), device)
    tri = launch_uniform_bits(key, step_t, numel, device)
    assert torch.equal(ref, tri)


def test_indices_beyond_two_to_the_32_agree(device):
    """Tensors over 2**32 elements: the high index bits enter the hash identically."""
    key, step = rng.host_key(9, 3, rng.STREAM_SHARED), torch.tensor(4.0, device=device)
    first = 2**32 - 700
    idx = torch.arange(first, first + 1500, dtype=torch.int64, device=device)
    ref = rng.element_bits(rng.step_hash(key, step), idx)
    tri = launch_uniform_bits(key, step, 1500, device, first=first)
    assert torch.equal(ref, tri)
    assert not torch.equal(ref[:700], ref[700 : 700 + 700])  # no wrap-around repetition


def test_tensor_and_integer_paths_agree():
    """The int64-tensor emulation of uint32 arithmetic equals exact Python-integer arithmetic."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 2**32, (4096,), generator=gen, dtype=torch.int64)
    values[:4] = torch.tensor([0, 1, 2**31, 2**32 - 1])
    expected = torch.tensor([rng.fmix32(int(v)) for v in values.tolist()])
    assert torch.equal(rng.fmix32(values), expected)
    # the fast int32 path (wrapping multiplication, masked shifts) on the same bit patterns
    assert torch.equal(rng._fmix32_int32(values.to(torch.int32)).to(torch.int64) & rng.MASK32, expected)
    assert int(rng.fmix32(values).max()) < 2**32 and int(rng.fmix32(values).min()) >= 0


def test_bits_are_uniform_and_keys_independent():
    step = torch.tensor(5.0)
    n = 1 << 16
    base = rng.uniform_bits(rng.host_key(0, 0, 1), step, torch.Size([n]), "cpu")
    u = base.double() / 2**32
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.005
    for bit in (0, 7, 15, 16, 31):  # every bit position is a fair coin
        assert abs(((base >> bit) & 1).double().mean().item() - 0.5) < 0.01
    # neighbours are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.02
    others = [
        rng.uniform_bits(rng.host_key(1, 0, 1), step, torch.Size([n]), "cpu"),  # seed
        rng.uniform_bits(rng.host_key(0, 1, 1), step, torch.Size([n]), "cpu"),  # parameter index
        rng.uniform_bits(rng.host_key(0, 0, 2), step, torch.Size([n]), "cpu"),  # stream
        rng.uniform_bits(rng.host_key(0, 0, 1), step + 1, torch.Size([n]), "cpu"),  # step
    ]
    for other in others:
        assert (other == base).double().mean().item() < 1e-3
    again = rng.uniform_bits(rng.host_key(0, 0, 1), step, torch.Size([n]), "cpu")
    assert torch.equal(again, base)


def test_bits_follow_row_major_element_index():
    step = torch.tensor(2.0)
    key = rng.host_key(3, 1, 16)
    flat = rng.uniform_bits(key, step, torch.Size([12]), "cpu")
    shaped = rng.uniform_bits(key, step, torch.Size([3, 4]), "cpu")
    assert torch.equal(shaped.flatten(), flat)


# --- default seeds: seedless one-parameter optimizers draw distinct streams ---------------------------


def _one_param_set(n=3, seed=None, steps=3, gen_seed=0):
    """``n`` identical bf16 parameters, each with a seedless one-parameter AdamW (8-bit moments, no
    correction: every update rounds stochastically), stepped on identical gradients."""
    gen = torch.Generator().manual_seed(gen_seed)
    w0 = torch.randn(32, 48, generator=gen).to(torch.bfloat16)
    grads = [torch.randn(32, 48, generator=gen).to(torch.bfloat16) for _ in range(steps)]
    params = [torch.nn.Parameter(w0.clone()) for _ in range(n)]
    kwargs = {} if seed is None else {"seed": seed}
    opts = [fusedopt.AdamW([p], lr=1e-2, state_bits=8, master_weight_bits=None, min_compress_numel=0, **kwargs)
            for p in params]  # fmt: skip
    _steps(params, opts, grads)
    return params, opts


def _steps(params, opts, grads):
    for g in grads:
        for p, opt in zip(params, opts):
            p.grad = g.clone()
            opt.step()
            opt.zero_grad()


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1].values(), b[1].values()))


def _snapshot(p, opt):
    return p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}


def test_seedless_one_parameter_optimizers_draw_distinct_streams():
    params, opts = _one_param_set()
    seeds = [opt.seed for opt in opts]
    assert len(set(seeds)) == 3 and all(rng.default_slot(s) is not None for s in seeds)
    assert len({s & rng.MASK32 for s in seeds} | {0}) == 4  # what the hash reads differs, and from seed 0
    runs = [_snapshot(p, opt) for p, opt in zip(params, opts)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not torch.equal(runs[i][0], runs[j][0]), (i, j)  # the rounding of the weights
            assert not torch.equal(runs[i][1]["exp_avg.codes"], runs[j][1]["exp_avg.codes"]), (i, j)  # the moments
    # an explicit seed is kept as given: all three draw the same (today's) stream
    same_params, same_opts = _one_param_set(seed=0)
    assert [opt.seed for opt in same_opts] == [0, 0, 0]
    assert _same(_snapshot(same_params[0], same_opts[0]), _snapshot(same_params[2], same_opts[2]))


def _seedless(p):
    return fusedopt.AdamW([p], lr=1e-2, state_bits=8, master_weight_bits=None, min_compress_numel=0)


def test_default_seeds_resume_and_repeat():
    """A resumed set (fresh optimizers that took other slots, the saved state dicts loaded) continues bit
    for bit; a set built after the first one trained takes the same seeds again, the first still alive."""
    params, opts = _one_param_set(steps=2)
    saved = [copy.deepcopy(opt.state_dict()) for opt in opts]  # (it holds the live state tensors)
    weights = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(5)
    more = [torch.randn(32, 48, generator=gen).to(torch.bfloat16) for _ in range(2)]
    _steps(params, opts, more)
    decoy = _seedless(torch.nn.Parameter(weights[0].clone()))  # takes slot 0 of the new group
    fresh = [torch.nn.Parameter(w.clone()) for w in weights]
    fresh_opts = [_seedless(p) for p in fresh]
    assert [rng.default_slot(opt.seed) for opt in [decoy, *fresh_opts]] == [0, 1, 2, 3]
    for opt, state in zip(fresh_opts, saved):
        opt.load_state_dict(state)
    assert [opt.seed for opt in fresh_opts] == [opt.seed for opt in opts]
    _steps(fresh, fresh_opts, more)
    for a, oa, b, ob in zip(params, opts, fresh, fresh_opts):
        assert _same(_snapshot(a, oa), _snapshot(b, ob))

    first_params, first_opts = _one_param_set(gen_seed=9)
    again_params, again_opts = _one_param_set(gen_seed=9)
    for a, oa, b, ob in zip(first_params, first_opts, again_params, again_opts):
        assert _same(_snapshot(a, oa), _snapshot(b, ob))


def test_default_seeds_leave_the_many_parameter_case_unchanged():
    """Seedless over several parameters: seed 0, bit for bit as seed=0 given; a one-parameter optimizer
    with seed=0 draws the stream of index 0 of seed 0, as before."""
    gen = torch.Generator().manual_seed(2)
    w0 = [torch.randn(32, 48, generator=gen).to(torch.bfloat16) for _ in range(2)]
    grads = [[torch.randn(32, 48, generator=gen).to(torch.bfloat16) for _ in range(2)] for _ in range(3)]
    kw = dict(lr=1e-2, state_bits=8, master_weight_bits=None, min_compress_numel=0)
    runs = []
    for make in (lambda ps: fusedopt.AdamW(ps, **kw), lambda ps: fusedopt.AdamW(ps, seed=0, **kw)):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = make(params)
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
            opt.zero_grad()
        assert opt.seed == 0
        runs.append([_snapshot(p, opt) for p in params])
    assert all(_same(a, b) for a, b in zip(*runs))
    alone = torch.nn.Parameter(w0[0].clone())
    alone_opt = fusedopt.AdamW([alone], seed=0, **kw)
    _steps([alone], [alone_opt], [gs[0] for gs in grads])
    assert _same(_snapshot(alone, alone_opt), runs[0][0])
    seedless = torch.nn.Parameter(w0[0].clone())
    seedless_opt = fusedopt.AdamW([seedless], **kw)
    _steps([seedless], [seedless_opt], [gs[0] for gs in grads])
    assert not torch.equal(seedless, alone)


def test_default_seed_groups():
    assert [rng.default_slot(rng.default_seed(s)) for s in (0, 1, 7, 2**20)] == [0, 1, 7, 2**20]
    assert all(rng.valid_seed(rng.default_seed(s)) for s in (0, 2**30 - 1))
    assert rng.default_slot(0) is None and rng.default_slot(rng.default_seed(3) ^ 1) is None

    class Owner:  # stands for an optimizer
        pass

    seeds = rng.DefaultSeeds()
    owners = [Owner() for _ in range(3)]
    first = [seeds.assign(o) for o in owners]
    assert [rng.default_slot(s) for s, _ in first] == [0, 1, 2] and len({g for _, g in first}) == 1
    del owners[1]  # dropped unused: its slot is the next one's, and no later slot shifts
    assert rng.default_slot(seeds.assign(keep := Owner())[0]) == 1
    seeds.used(first[1][1])  # one of them is used: the next optimizer starts a new group
    second_owners = [Owner() for _ in range(2)]
    second = [seeds.assign(o) for o in second_owners]
    assert [s for s, _ in second] == [s for s, _ in first[:2]] and second[0][1] != first[0][1]
    seeds.used(first[0][1])  # a use in an earlier group changes nothing
    assert rng.default_slot(seeds.assign(Owner())[0]) == 2
    del keep


def _joint_chi2_per_dof(a: torch.Tensor, b: torch.Tensor, bins: int = 32) -> float:
    """Pearson's chi-square per degree of freedom of the joint histogram of uniforms ``a``, ``b`` (about 1 when
    independent; its sd is about sqrt(2 / (bins**2 - 1)), 0.044 here)."""
    cells = (a * bins).long() * bins + (b * bins).long()
    counts = torch.bincount(cells, minlength=bins * bins).double()
    expected = a.numel() / bins**2
    return (((counts - expected) ** 2) / expected).sum().item() / (bins * bins - 1)


def test_the_second_word_is_independent_of_the_shared_words_fields():
    """The second moment's word is the shared word re-mixed (``second_word``): its top 21 bits (what the root grid
    reads) are uniform and independent of every field of the shared word another rounding reads: the first
    moment's top 23 (or 16) bits, the parameter's low 8 (or 16), and the fine bits that decide a rounding."""
    n = 1 << 20
    shared = rng.uniform_bits(rng.host_key(3, 1, rng.STREAM_SHARED), torch.tensor(7.0), torch.Size([n]), "cpu")
    second = rng.second_word(shared)
    assert int(second.min()) >= 0 and int(second.max()) < 2**32
    assert [rng.second_word(int(s)) for s in shared[:64].tolist()] == second[:64].tolist()  # ints agree
    v = (second >> 11).double() / 2**21
    assert abs(v.mean().item() - 0.5) < 0.002 and abs(v.var().item() - 1 / 12) < 0.001
    for bit in (11, 16, 24, 31):
        assert abs(((second >> bit) & 1).double().mean().item() - 0.5) < 0.002
    fields = {
        "first moment, 23 bits": (shared >> 9).double() / 2**23,
        "first moment, 16 bits": (shared >> 16).double() / 2**16,
        "parameter, 8 bits": (shared & 0xFF).double() / 2**8,
        "parameter, 16 bits": (shared & 0xFFFF).double() / 2**16,
        "first moment's fine bits": ((shared >> 9).double() / 2**13) % 1.0,
    }
    for name, u in fields.items():
        target = (v * 2**10) % 1.0 if "fine" in name else v
        assert abs(torch.corrcoef(torch.stack([u, target]))[0, 1].item()) < 0.005, name
        assert _joint_chi2_per_dof(u, target) < 1.25, name
