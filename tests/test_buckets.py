"""Bucketed kernel updates (fusedopt/dispatch.py, kernels/bucket.py): several parameters' updates
in one launch pair give bit-for-bit the results of one launch pair per parameter.

Runs the kernel through the public API: Triton's interpreter on the CPU, the compiled kernel on a
GPU. ``FUSEDOPT_BUCKET_MB=0`` (one launch pair per parameter) is the baseline every bucketed run
is held against, on the same device.
"""

import pytest
import torch
from cases import config, config_cases, dtype_cases

import fusedopt
from fusedopt.kernels import bucket, launcher, update

# sizes a bucket takes (multiples of 16 elements) and ones it does not (odd: launched alone)
SHAPES = [(32, 48), (16, 24), (48, 17), (64, 40), (5, 7)]


def _params(device, dtype, shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes]


def _grads(shapes, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


def _train(
    monkeypatch, device, bucket_mb, opt_cls, kwargs, dtype, fused, shapes=SHAPES, steps=3, built=None, changes=None,
    moved=(), reversed_views=False,
):  # fmt: skip
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", str(bucket_mb))
    params = _params(device, dtype, shapes)
    opt = opt_cls(params, lr=1e-2, fused=fused, **{"min_compress_numel": 0, **kwargs})
    for i, grads in enumerate(_grads(shapes, steps)):
        opt.param_groups[0].update((changes or {}).get(i, {}))  # e.g. a scheduler's, between steps
        if i in moved:  # every other parameter's storage replaced, as Module._apply does (p.data = ...)
            for p in params[::2]:
                p.data = p.data.clone()
        if fused:
            sum((p * g.to(device, dtype)).sum() for p, g in zip(params, grads)).backward()
            assert all(p.grad is None for p in params)  # released: updated by the end of backward
        elif reversed_views:  # views of one buffer, parameter 0's last: each gradient below the one before
            buffer = torch.cat([g.reshape(-1) for g in reversed(grads)]).to(device, dtype)
            end = buffer.numel()
            for p, g in zip(params, grads):
                p.grad, end = buffer[end - g.numel() : end].view(g.shape), end - g.numel()
        else:
            for p, g in zip(params, grads):
                p.grad = g.to(device, dtype)
        opt.step()
        opt.zero_grad()
    if built is not None:
        built.extend(len(b.members) for b in opt._dispatch._built.values())
    # every parameter was updated (two runs that both skipped updates would be "identical" too)
    assert all(not torch.equal(p.detach().cpu(), p0.cpu()) for p, p0 in zip(params, _params(device, dtype, shapes)))
    return [p.detach().cpu() for p in params], [{k: v.cpu() for k, v in opt.state[p].items()} for p in params], opt


def _assert_identical(a, b):
    for pa, pb in zip(a[0], b[0]):
        assert torch.equal(pa, pb)
    for sa, sb in zip(a[1], b[1]):
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


# Chosen combinations (each takes ~7 s in the interpreter): every kernel branch, state format, dtype
# and master-weight setting at least once
CONFIGS = config_cases(
    config("adamw", 8, torch.bfloat16, 24),
    config("adamw", 4, torch.bfloat16, 32),
    config("adamw", 32, torch.float32),
    config("sgd-nesterov", 16, torch.float16),
    config("lion", 8, torch.bfloat16, None),
)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", CONFIGS)
def test_buckets_are_bit_identical_to_one_launch_per_parameter(monkeypatch, device, case, fused):
    opt_cls, kwargs, dtype = case.cls, case.kwargs, case.dtype
    built = []
    alone = _train(monkeypatch, device, 0, opt_cls, kwargs, dtype, fused)
    together = _train(monkeypatch, device, 64, opt_cls, kwargs, dtype, fused, built=built)
    assert alone[2].bucket_budget == 0
    assert built and max(built) >= 3  # the three sizes that are multiples of 16 went in one bucket
    _assert_identical(alone, together)


@pytest.mark.parametrize("fused", [False, True])
def test_group_changes_between_steps_reach_bucketed_updates(monkeypatch, device, fused):
    """Buckets take each group's hyperparameters once per step: a change between steps (lr
    schedule, weight decay, maximize) must reach the next step's updates."""
    changes = {1: dict(lr=3e-3), 2: dict(lr=5e-3, weight_decay=0.3), 3: dict(maximize=True)}
    kwargs, built = dict(state_bits=8), []
    alone = _train(monkeypatch, device, 0, fusedopt.AdamW, kwargs, torch.bfloat16, fused, steps=5, changes=changes)
    together = _train(
        monkeypatch, device, 64, fusedopt.AdamW, kwargs, torch.bfloat16, fused, steps=5, built=built, changes=changes
    )
    assert built and max(built) >= 3
    _assert_identical(alone, together)


def test_parameters_moved_to_new_storage_between_steps(monkeypatch, device):
    """A bucket's table points into its members' storage: a parameter whose storage was replaced
    (``p.data = ...``) must get a new one, never an update written to the old storage. (Release
    and step() check a prepared launch alike, in ``queue_update``.)"""
    kwargs, built = dict(state_bits=8), []
    alone = _train(monkeypatch, device, 0, fusedopt.AdamW, kwargs, torch.bfloat16, True, steps=4, moved=(2,))
    together = _train(
        monkeypatch, device, 64, fusedopt.AdamW, kwargs, torch.bfloat16, True, steps=4, built=built, moved=(2,)
    )
    assert built and max(built) >= 3
    _assert_identical(alone, together)


def test_more_parameters_than_one_bucket_holds(monkeypatch, device):
    shapes = [(16, 16 + 16 * (i % 3)) for i in range(bucket.BUCKET_TENSORS + 3)]
    built = []
    kwargs = dict(state_bits=8)
    alone = _train(monkeypatch, device, 0, fusedopt.AdamW, kwargs, torch.bfloat16, True, shapes, steps=2)
    together = _train(monkeypatch, device, 64, fusedopt.AdamW, kwargs, torch.bfloat16, True, shapes, 2, built)
    assert sorted(built) == [3, bucket.BUCKET_TENSORS]
    _assert_identical(alone, together)


def test_members_of_several_check_programs(monkeypatch, device):
    """Each program finds its member from the table's first-program columns: members of several
    check programs (16384 elements each) and update programs (update.BLOCK) between small ones."""
    shapes = [(16, 16), (2, 8200), (48, 32)]  # 2 check programs and 17 update programs, then 2
    built = []
    kwargs = dict(state_bits=8)
    alone = _train(monkeypatch, device, 0, fusedopt.AdamW, kwargs, torch.bfloat16, False, shapes, steps=2)
    together = _train(monkeypatch, device, 64, fusedopt.AdamW, kwargs, torch.bfloat16, False, shapes, 2, built)
    assert built == [len(shapes)]
    _assert_identical(alone, together)


def test_gradients_below_the_first_members_address(monkeypatch, device):
    """A member's gradient is the first member's pointer plus a delta from the launch arguments: the
    gradients here are views of one buffer in reverse order, so every delta is negative."""
    shapes = [(16, 24), (32, 48), (16, 16)]
    built = []
    kwargs = dict(state_bits=8)
    alone = _train(
        monkeypatch, device, 0, fusedopt.AdamW, kwargs, torch.bfloat16, False, shapes, 2, reversed_views=True
    )
    together = _train(
        monkeypatch, device, 64, fusedopt.AdamW, kwargs, torch.bfloat16, False, shapes, 2, built, reversed_views=True
    )
    assert built == [len(shapes)]
    _assert_identical(alone, together)


# the kernel computes on the non-finite gradient and only masks its stores: numpy (the
# interpreter) warns about the NaN it makes on the way
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_non_finite_gradient_in_a_bucket_skips_only_its_parameter(monkeypatch, device):
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", "64")
    shapes = [(32, 48), (16, 24), (64, 40)]
    params = _params(device, torch.bfloat16, shapes)
    opt = fusedopt.AdamW(params, lr=1e-2, state_bits=8, min_compress_numel=0)
    first, second = _grads(shapes, 2)
    for p, g in zip(params, first):
        p.grad = g.to(device, torch.bfloat16)
    opt.step()  # builds the prepared launches: the next step goes in one bucket
    before = [p.detach().clone() for p in params], [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    second[1][3, 5] = float("nan")
    second[2][63, 39] = float("inf")  # the last element of the bucket's last member
    for p, g in zip(params, second):
        p.grad = g.to(device, torch.bfloat16)
    opt.step()
    assert [len(b.members) for b in opt._dispatch._built.values()] == [3]
    assert not torch.equal(params[0], before[0][0])
    assert float(opt.state[params[0]]["step"]) == 2
    for i in (1, 2):
        assert torch.equal(params[i], before[0][i])
        for k, v in before[1][i].items():
            assert torch.equal(opt.state[params[i]][k], v), (i, k)
    assert int(opt.num_skipped_updates) == 2


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("fused", [False, True])
# the kernel computes on the skipped gradients and only masks its stores (numpy warns in the interpreter)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_clipping_skips_each_gradient_whose_norm_is_not_finite_by_its_coefficient(monkeypatch, device, fused, backend):
    """max_grad_norm: a gradient holding a NaN, and one whose values are finite but whose squares
    overflow fp32 (its norm is inf), are each skipped alone, in one bucket with finite ones; the
    others are clipped by the norm of the finite gradients. The kernel learns it from each member's
    own coefficient (NaN): its check reads one word per parameter, not the gradients."""
    if backend == "reference" and device != "cpu":
        pytest.skip("the reference backend is the CPU path")
    monkeypatch.setenv("FUSEDOPT_BACKEND", backend)
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", "64")
    shapes = [(32, 48), (16, 24), (64, 40), (48, 16)]
    checks = []  # (programs, SCALE_GRAD, BUCKET) of every check launch
    real_launch = launcher.launch_remembered

    def recording(launch, remembered, variant, grid, runtime_args, config):
        if launch is update._launch_check:
            checks.append((grid, config.constexprs["SCALE_GRAD"], config.constexprs["BUCKET"]))
        return real_launch(launch, remembered, variant, grid, runtime_args, config)

    monkeypatch.setattr(update, "launch_remembered", recording)
    monkeypatch.setattr(bucket, "launch_remembered", recording)

    def run(mode: str):  # "poisoned", "clean", or "absent": parameters 1 and 2 get no second gradient
        params = _params(device, torch.bfloat16, shapes)
        opt = fusedopt.AdamW(params, lr=1e-2, state_bits=8, min_compress_numel=0, max_grad_norm=0.5, fused=fused)
        for step, grads in enumerate(_grads(shapes, 2)):
            used = range(len(shapes))
            if step == 1:
                before = [p.detach().clone() for p in params]
                before_state = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
                checks.clear()
                if mode == "poisoned":
                    grads[1][3, 5] = float("nan")
                    grads[2][0, 0] = 1e30  # finite in bf16; its square is not in fp32
                if mode == "absent":
                    used = (0, 3)
            if fused:
                sum((params[i] * grads[i].to(device, torch.bfloat16)).sum() for i in used).backward()
            else:
                for i in used:
                    params[i].grad = grads[i].to(device, torch.bfloat16)
            opt.step()
            opt.zero_grad()
        return params, opt, before, before_state

    params, opt, before, before_state = run("poisoned")
    assert not torch.isfinite(opt.grad_norm)
    for i in (1, 2):  # skipped: parameter, state and step count as they were
        assert torch.equal(params[i], before[i])
        for k, v in before_state[i].items():
            assert torch.equal(opt.state[params[i]][k], v), (i, k)
    assert int(opt.num_skipped_updates) == 2
    if backend == "triton":
        assert checks and all(scaled for _, scaled, _ in checks)  # every clipped update's check by coefficient
        assert any(bucketed and grid > 1 for grid, _, bucketed in checks)  # a bucket: a program per member
        assert all(grid == 1 for grid, _, bucketed in checks if not bucketed)
    clean, clean_opt, _, _ = run("clean")
    assert float(clean_opt.grad_norm) > 0.5  # it clipped
    for i in (0, 3):  # updated
        assert float(opt.state[params[i]]["step"]) == 2
        assert not torch.equal(params[i], before[i])
    # by another coefficient than with every gradient finite (one released before the others, alone
    # on the reference path, was clipped before they were seen)
    assert any(not torch.equal(params[i], clean[i]) for i in (0, 3))
    if not fused:  # step(): clipped exactly as if the two had no gradient (release's estimate has history)
        absent, _, _, _ = run("absent")
        for i in (0, 3):
            assert torch.equal(params[i], absent[i])


def test_release_holds_less_than_the_budget(monkeypatch, device):
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    budget_mb = 0.004  # 4.2 kB: release updates after every third of these gradients
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", str(budget_mb))
    shapes = [(32, 32)] * 6  # 2 kB bf16 gradients
    params = _params(device, torch.bfloat16, shapes)
    opt = fusedopt.AdamW(params, lr=1e-2, state_bits=8, min_compress_numel=0, fused=True)
    held = []

    def record(_):
        held.append(opt._release._held_bytes)

    for p in params:  # registered after the optimizer's hook: runs after it
        p.register_post_accumulate_grad_hook(record)
    for grads in _grads(shapes, 2):
        sum((p * g.to(device, torch.bfloat16)).sum() for p, g in zip(params, grads)).backward()
        opt.step()
    assert max(held) > 0  # gradients were held for a bucket
    assert max(held) < budget_mb * 2**20
    assert sorted({len(b.members) for b in opt._dispatch._built.values()}) == [3]


@pytest.mark.parametrize("fused", [False, True])
def test_large_parameters_are_launched_alone(monkeypatch, device, fused):
    """From bucket.MAX_MEMBER_NUMEL elements a parameter launches alone (a bucket's member lookup
    costs GPU time on every element; its saving is host time per parameter), with the same result."""
    monkeypatch.setattr(bucket, "MAX_MEMBER_NUMEL", 64 * 40)
    kwargs, built = dict(state_bits=8), []
    shapes = [(32, 48), (16, 24), (64, 40), (16, 16), (64, 39)]  # 1536, 384, 2560 (alone), 256, 2496
    alone = _train(monkeypatch, device, 0, fusedopt.AdamW, kwargs, torch.bfloat16, fused, shapes, 2)
    together = _train(monkeypatch, device, 64, fusedopt.AdamW, kwargs, torch.bfloat16, fused, shapes, 2, built)
    assert built == [4]  # every size but 2560 in one bucket
    _assert_identical(alone, together)


def test_release_holds_only_updates_that_can_join_a_bucket(monkeypatch, device):
    """A parameter launched alone gains nothing from waiting: its hook updates it at once, where a
    bucketable one's gradient is held (seen from a hook of the user's that runs after release's)."""
    monkeypatch.setattr(bucket, "MAX_MEMBER_NUMEL", 64 * 40)
    monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", "64")
    shapes = [(32, 48), (64, 40)]  # 1536 elements (bucketable), 2560 (launched alone)
    params = _params(device, torch.bfloat16, shapes)
    opt = fusedopt.AdamW(params, lr=1e-2, fused=True, state_bits=8, min_compress_numel=0)
    held = {}

    def seen(i):
        return lambda p: held.update({i: any(q is p for q, _, _ in opt._release._held)})

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(seen(i))
    for grads in _grads(shapes, 3):
        sum((p * g.to(device, torch.bfloat16)).sum() for p, g in zip(params, grads)).backward()
        opt.step()
        opt.zero_grad()
    assert held == {0: True, 1: False}  # the last step's (the first has no prepared launches yet)


def test_misaligned_gradient_is_launched_alone(monkeypatch, device):
    """A gradient that is a view one element into its storage cannot join a bucket (its vector
    accesses would be misaligned): it is launched alone, with the same result."""
    results = []
    for mb in (0, 64):
        monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
        monkeypatch.setenv("FUSEDOPT_BUCKET_MB", str(mb))
        shapes = [(32, 48), (16, 24), (64, 40)]
        params = _params(device, torch.bfloat16, shapes)
        opt = fusedopt.AdamW(params, lr=1e-2, state_bits=8, min_compress_numel=0)
        for grads in _grads(shapes, 3):
            for p, g in zip(params, grads):
                storage = torch.empty(g.numel() + 1, device=device, dtype=torch.bfloat16)
                p.grad = storage[1:].view(g.shape).copy_(g)
                assert p.grad.data_ptr() % bucket.ALIGN != 0
            opt.step()
        if mb:
            assert not opt._dispatch._built  # nothing went in a bucket
        states = [{k: v.cpu() for k, v in opt.state[p].items()} for p in params]
        results.append(([p.detach().cpu() for p in params], states))
    _assert_identical(*results)


@pytest.mark.parametrize("value", ["-1", "lots", "nan"])
def test_invalid_bucket_budget_is_an_error(monkeypatch, value):
    monkeypatch.setenv("FUSEDOPT_BUCKET_MB", value)
    with pytest.raises(ValueError, match="FUSEDOPT_BUCKET_MB"):
        fusedopt.AdamW([torch.nn.Parameter(torch.randn(4, 4))])


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


def test_updates_held_by_a_failed_backward_are_dropped(monkeypatch, device):
    """Release holds kernel updates until the end of backward; a backward that raises never gets
    there, and what it held is dropped with its window: the batch thrown away never lands. An update
    launched at once (no buckets) before the failure stays."""
    for mb in (0, 64):
        monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
        monkeypatch.setenv("FUSEDOPT_BUCKET_MB", str(mb))
        a, b = _params(device, torch.bfloat16, [(32, 48), (16, 24)])
        opt = fusedopt.AdamW([a, b], lr=1e-2, state_bits=8, min_compress_numel=0, fused=True)
        ga, gb = (g.to(device, torch.bfloat16) for g in _grads([(32, 48), (16, 24)], 1)[0])

        def loss(fail, a=a, b=b, ga=ga, gb=gb):
            tail = _FailingBackward.apply(b * gb) if fail else b * gb  # created first: runs last in backward
            return (a * ga).sum() + tail.sum()

        loss(False).backward()
        opt.step()  # the prepared launches exist from here: the next updates are held
        a_before = a.detach().clone()
        with pytest.raises(RuntimeError, match="on purpose"):
            loss(True).backward()
        assert a.grad is None and b.grad is None
        assert opt._release.holds_updates() == bool(mb)  # a's update waits in a bucket
        with pytest.warns(UserWarning, match=f"{0 if mb else 1} parameter update"):
            opt.step()
        assert not opt._release.holds_updates()
        assert float(opt.state[a]["step"]) == (1 if mb else 2) and float(opt.state[b]["step"]) == 1
        assert torch.equal(a.detach(), a_before) == bool(mb)
        loss(False).backward()  # the next batch trains as usual
        opt.step()
        assert float(opt.state[a]["step"]) == (2 if mb else 3) and float(opt.state[b]["step"]) == 2


# fp32 (held and bucketed) and bf16 (the accumulation buffer, launched alone): fp16 takes bf16's path
@pytest.mark.parametrize("dtype", dtype_cases(torch.float32, torch.bfloat16))
def test_release_with_accumulation_and_two_groups(monkeypatch, device, dtype):
    """Two parameter groups (each its own buckets) and accumulation over two backward passes:
    bf16 gradients go through the optimizer's buffer (launched alone), fp32 ones stay in p.grad
    and are held for buckets. Bucketed and unbucketed runs agree bit for bit."""
    shapes = [(32, 48), (16, 24), (64, 40), (48, 16)]
    results = []
    for mb in (0, 64):
        monkeypatch.setenv("FUSEDOPT_BACKEND", "triton")
        monkeypatch.setenv("FUSEDOPT_BUCKET_MB", str(mb))
        params = _params(device, dtype, shapes)
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.2}]
        opt = fusedopt.AdamW(groups, lr=1e-2, state_bits=8, min_compress_numel=0, fused=True, accumulation_steps=2)
        for grads in _grads(shapes, 6):
            sum((p * g.to(device, dtype)).sum() for p, g in zip(params, grads)).backward()
            sum((p * (0.5 * g).to(device, dtype)).sum() for p, g in zip(params, grads)).backward()
            assert all(p.grad is None for p in params)
            opt.step()
        if mb:  # fp32 gradients were held and bucketed (one bucket per group); bf16 ones went alone
            assert sorted(len(b.members) for b in opt._dispatch._built.values()) == (
                [2, 2] if dtype == torch.float32 else []
            )
        states = [{k: v.cpu() for k, v in opt.state[p].items()} for p in params]
        results.append(([p.detach().cpu() for p in params], states))
    _assert_identical(*results)


def _torch_norms(tensors):
    """``dispatch.total_norm`` through torch's ops: the total norm and each tensor's."""
    each = torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors])
    return torch.nn.utils.get_total_norm(tensors), each


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", [CONFIGS[0], CONFIGS[2], CONFIGS[3]])
def test_clipping_in_the_kernel_equals_clipping_before_it_bit_for_bit(monkeypatch, device, case, fused):
    """max_grad_norm: the kernel multiplies each gradient by the coefficient as it reads it (bucketed
    and alone); the same gradients scaled first by ``fusedopt.clipping.scale_`` and updated by the
    kernel without a coefficient give the same parameters and state, and so does the reference path
    with fused=False in the interpreter (under release it batches the clipping differently: its
    updates are not held).
    A run without clipping differs, so the clipping was applied."""
    kwargs = {**case.kwargs, "max_grad_norm": 0.5}
    # one norm for every path (the norm kernel is held to torch's in test_kernels.py)
    monkeypatch.setattr("fusedopt.gradients.total_norm", _torch_norms)
    in_kernel = _train(monkeypatch, device, 64, case.cls, kwargs, case.dtype, fused)
    with monkeypatch.context() as m:
        m.setattr("fusedopt.dispatch._takes_grad_scale", lambda launch: False)
        before_kernel = _train(monkeypatch, device, 64, case.cls, kwargs, case.dtype, fused)
    _assert_identical(in_kernel, before_kernel)
    if not fused and device == "cpu":  # on the GPU the fp32 reference is held to the kernel within bounds only
        with monkeypatch.context() as m:
            m.setattr("fusedopt.dispatch.backend_choice", lambda: "reference")
            _assert_identical(in_kernel, _train(m, device, 64, case.cls, kwargs, case.dtype, fused))
    assert float(in_kernel[2].grad_norm) > 0.5  # every step clipped
    unclipped = _train(monkeypatch, device, 64, case.cls, case.kwargs, case.dtype, fused)
    assert not torch.equal(unclipped[0][0], in_kernel[0][0])


def test_a_bucket_multiplies_each_member_by_its_own_coefficient(monkeypatch, device):
    """release_clipping="adagc" clips each gradient by a coefficient of its own once its average has
    history: a bucket's members then carry different coefficients, each applied to its own gradient in
    the kernel, bit for bit as the same gradients scaled first by ``scale_`` and updated unscaled."""
    case = CONFIGS[0].values[0]
    kwargs = {**case.kwargs, "max_grad_norm": 0.5, "release_clipping": "adagc"}
    seen = []
    real_launch = bucket.PreparedBucket.launch

    def recording(self, grads, scalars, grad_scales=None):
        if grad_scales is not None:
            seen.append([float(c) for c in grad_scales])
        return real_launch(self, grads, scalars, grad_scales)

    monkeypatch.setattr(bucket.PreparedBucket, "launch", recording)
    steady = _grads

    def spiking(shapes, steps):  # the last step: one gradient 30 times its usual norm
        grads = steady(shapes, steps)
        grads[-1][1] = grads[-1][1] * 30
        return grads

    monkeypatch.setitem(globals(), "_grads", spiking)
    in_kernel = _train(monkeypatch, device, 64, case.cls, kwargs, case.dtype, True, steps=13)
    assert any(len(set(c)) > 1 for c in seen)  # a bucket whose members' coefficients differ
    with monkeypatch.context() as m:
        m.setattr("fusedopt.dispatch._takes_grad_scale", lambda launch: False)
        _assert_identical(in_kernel, _train(m, device, 64, case.cls, kwargs, case.dtype, True, steps=13))
