"""torchtune: released gradients normalised as the recipe normalises them (fusedopt.integrations.torchtune).

torchtune's full_finetune_single_device recipe backpropagates ``loss * num_tokens`` and multiplies the
gradients by ``1 / num_tokens`` of the accumulation window after backward (``training.scale_grads``).
With ``fused=True`` the optimizer's ``grad_multiplier`` does that multiplication on each released
gradient: the result equals ``fused=False`` with ``scale_grads`` bit for bit (fp32), and clipping sees
the normalised norm. A releasing optimizer built by torchtune's config for the stock recipe is refused.
"""

import pytest

pytest.importorskip("torchtune")
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's, inside the recipe

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torchtune import config, training  # noqa: E402

import fusedopt  # noqa: E402
from fusedopt import rng  # noqa: E402
from fusedopt.integrations import torchtune as ft  # noqa: E402
from fusedopt.optimizer import NORMALISES_RELEASED_GRADS  # noqa: E402

IGNORE = -100
VOCAB = 48
MAX_NORM = 5.0


# --- the normalisation, in a loop written as the recipe's -------------------------------------------


def _tiny_lm(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 32), torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, VOCAB)
    )


def _micro_batches(n, seed=1):
    """``n`` micro-batches of 2 x 12 tokens whose labels mask a different number of positions."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(n):
        tokens = torch.randint(0, VOCAB, (2, 12), generator=gen)
        labels = torch.randint(0, VOCAB, (2, 12), generator=gen)
        labels[0, : 2 + 3 * (i % 3)] = IGNORE  # a prompt of varying length
        labels[1, 12 - i % 4 :] = IGNORE  # and padding
        batches.append((tokens, labels))
    return batches


def _loss(model, tokens, labels):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE)


def _recipe_loop(model, opt, batches, k, *, released: bool, multiplier: bool = True):
    """The recipe's train() loop: loss * num_tokens backpropagated per micro-batch; every k-th,
    scale_grads(1 / num_tokens of the window), step. ``released``: tell the optimizer the factor before
    each backward instead (what FullFinetuneRecipeSingleDevice does). Returns each step's grad_norm and
    the weights after each step."""
    norms, weights, num_tokens = [], [], 0
    for idx, (tokens, labels) in enumerate(batches):
        current = (labels != IGNORE).sum()
        num_tokens += current
        if released and multiplier:
            opt.grad_multiplier = 1 / num_tokens
        (_loss(model, tokens, labels) * current).backward()
        if (idx + 1) % k == 0:
            training.scale_grads(model, 1 / num_tokens)
            opt.step()
            opt.zero_grad(set_to_none=True)
            norms.append(opt.grad_norm.clone())
            weights.append([p.detach().clone() for p in model.parameters()])
            num_tokens = 0
    return norms, weights


@pytest.mark.parametrize("k", [1, 3])
def test_released_gradients_normalised_as_scale_grads(k):
    """fused=True with grad_multiplier = 1/num_tokens set before each backward equals fused=False with
    torchtune's scale_grads after the window, bit for bit, and clips by the same (normalised) norm."""
    batches = _micro_batches(4 * k)
    plain = _tiny_lm()
    opt_plain = fusedopt.AdamW(plain.parameters(), lr=1e-2, max_grad_norm=MAX_NORM)
    norms_plain, weights_plain = _recipe_loop(plain, opt_plain, batches, k, released=False)
    model = _tiny_lm()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, max_grad_norm=MAX_NORM, fused=True, accumulation_steps=k)
    norms, weights = _recipe_loop(model, opt, batches, k, released=True)
    for step, (a, b) in enumerate(zip(weights, weights_plain)):
        for x, y in zip(a, b):
            assert torch.equal(x, y), step
    torch.testing.assert_close(torch.stack(norms), torch.stack(norms_plain), rtol=1e-6, atol=0)
    # normalised, nothing clips (clipping under release is bit-identical only then); the sums over
    # tokens would clip (the next test)
    assert all(float(n) < MAX_NORM for n in norms)


def test_without_the_multiplier_release_sees_token_sums():
    """What the multiplier fixes: released gradients are the sums over tokens (scale_grads finds none)."""
    batches = _micro_batches(2)
    model = _tiny_lm()
    opt = fusedopt.AdamW(model.parameters(), lr=1e-2, max_grad_norm=MAX_NORM, fused=True, accumulation_steps=2)
    norms, _ = _recipe_loop(model, opt, batches, 2, released=True, multiplier=False)
    plain = _tiny_lm()
    opt_plain = fusedopt.AdamW(plain.parameters(), lr=1e-2, max_grad_norm=MAX_NORM)
    norms_plain, _ = _recipe_loop(plain, opt_plain, batches, 2, released=False)
    tokens = sum(int((labels != IGNORE).sum()) for _, labels in batches)
    torch.testing.assert_close(norms[0], norms_plain[0] * tokens, rtol=1e-5, atol=0)
    assert float(norms[0]) > MAX_NORM


def test_grad_multiplier_in_step_and_validation():
    """fused=False: step() multiplies p.grad as scale_grads would; the setter keeps an fp32 0-d tensor."""
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = fusedopt.AdamW([w], state_bits=32, lr=1e-2)
    g = torch.randn(8, 8)
    opt.grad_multiplier = torch.tensor(7, dtype=torch.int64)
    assert opt.grad_multiplier.dtype == torch.float32 and opt.grad_multiplier.shape == ()
    opt.grad_multiplier = 0.25
    w.grad = g.clone()
    opt.step()
    assert torch.equal(w.grad, g * torch.tensor(0.25))
    for bad in (0.0, -1.0, float("nan"), torch.ones(2), torch.tensor(True)):
        with pytest.raises(ValueError, match="grad_multiplier"):
            opt.grad_multiplier = bad
    opt.grad_multiplier = None
    assert opt.grad_multiplier is None


# --- refusing torchtune's stock recipe under release -------------------------------------------------


def test_torchtune_config_building_a_releasing_optimizer_is_refused():
    params = list(_tiny_lm().parameters())
    node = OmegaConf.create({"_component_": "fusedopt.AdamW", "lr": 1e-3, "fused": True, "max_grad_norm": 1.0})
    with pytest.raises(ValueError, match="training.scale_grads"):
        config.instantiate(node, params)
    # fused=False (scale_grads finds the gradients) and fusedopt's own recipe are fine
    config.instantiate(OmegaConf.merge(node, {"fused": False}), params)
    assert getattr(ft.FullFinetuneRecipeSingleDevice, NORMALISES_RELEASED_GRADS) is True
    # and built directly (not by torchtune), release is the caller's business
    fusedopt.AdamW(params, fused=True, max_grad_norm=1.0).remove_hooks()


# --- torchtune's real recipe on a tiny Llama (CPU) ---------------------------------------------------

_STORE: dict = {}


class TinyTokenizer:
    pad_id = 0


class TinyDataset(torch.utils.data.Dataset):
    """Token sequences of varying length whose first tokens (a prompt) are masked out of the labels."""

    def __init__(self, tokenizer, n=16, seed=3):
        gen = torch.Generator().manual_seed(seed)
        self.samples = []
        for i in range(n):
            length = 6 + (5 * i) % 11
            tokens = torch.randint(1, VOCAB, (length,), generator=gen).tolist()
            prompt = 1 + i % 4
            self.samples.append({"tokens": tokens, "labels": [IGNORE] * prompt + tokens[prompt:]})

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


class MemoryCheckpointer:
    """Loads the initial weights from ``_STORE[key]``; keeps what the recipe saves in ``_STORE``."""

    def __init__(self, key, should_load_recipe_state=False):
        self.key = key

    def load_checkpoint(self):
        return {training.MODEL_KEY: {k: v.clone() for k, v in _STORE[self.key].items()}}

    def save_checkpoint(self, state_dict, epoch, intermediate_checkpoint=False):
        _STORE[(self.key, "saved", epoch)] = state_dict


class RecordingLogger:
    def __init__(self):
        self.records = []

    def log_config(self, cfg):
        pass

    def log(self, name, data, step):
        self.records.append({name: data, "step": step})

    def log_dict(self, payload, step):
        self.records.append({**payload, "step": step})

    def close(self):
        pass


MODEL = dict(
    _component_="torchtune.models.llama3.llama3",
    vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64, intermediate_dim=64,
)  # fmt: skip


def _recipe_config(tmp_path, **overrides):
    here = __name__
    cfg = dict(
        output_dir=str(tmp_path), seed=0, device="cpu", dtype="fp32", compile=False, shuffle=False,
        resume_from_checkpoint=False, gradient_accumulation_steps=2, optimizer_in_bwd=False, clip_grad_norm=None,
        epochs=1, max_steps_per_epoch=3, batch_size=2, log_every_n_steps=1,
        model=MODEL,
        tokenizer={"_component_": f"{here}.TinyTokenizer"},
        dataset={"_component_": f"{here}.TinyDataset"},
        checkpointer={"_component_": f"{here}.MemoryCheckpointer", "key": "init"},
        metric_logger={"_component_": f"{here}.RecordingLogger"},
        loss={"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        optimizer={"_component_": "fusedopt.AdamW", "lr": 2e-3, "fused": True, "max_grad_norm": MAX_NORM},
    )  # fmt: skip
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return OmegaConf.create(cfg)


@pytest.fixture
def initial_weights():
    torch.manual_seed(11)
    _STORE["init"] = config.instantiate(OmegaConf.create(MODEL)).state_dict()
    yield
    _STORE.clear()


def _run(recipe_cls, cfg, on_step=None):
    recipe = recipe_cls(cfg=cfg)
    recipe.setup(cfg=cfg)
    if on_step is not None:
        recipe._optimizer.register_step_post_hook(on_step)
    recipe.train()
    recipe.cleanup()
    return recipe


def test_recipe_fused_equals_stock_recipe_unfused(tmp_path, initial_weights):
    """torchtune's real recipe, a tiny Llama on CPU, 3 steps of 2 micro-batches with clipping: fusedopt's
    recipe with fused=True trains bit for bit as torchtune's own with fused=False, and logs its norm."""
    stock_norms = []
    stock = _run(
        ft.StockFullFinetuneRecipeSingleDevice,
        _recipe_config(tmp_path, optimizer={"fused": False}),
        on_step=lambda opt, *_: stock_norms.append(opt.grad_norm.clone()),
    )
    ours = _run(ft.FullFinetuneRecipeSingleDevice, _recipe_config(tmp_path))
    assert ours._optimizer.fused and ours._optimizer.accumulation_steps == 2  # from the recipe
    assert len(stock_norms) == 3
    for name, value in stock._model.state_dict().items():
        assert torch.equal(ours._model.state_dict()[name], value), name
    records = ours._metric_logger.records
    stock_records = stock._metric_logger.records
    assert [r["loss"] for r in records] == [r["loss"] for r in stock_records]
    logged = torch.stack([r["grad_norm"] for r in records])
    torch.testing.assert_close(logged, torch.stack(stock_norms), rtol=1e-6, atol=0)
    # the normalised norm, which does not clip (the sums over tokens would: about 40 times it)
    assert float(logged.max()) < MAX_NORM


CLIP = 0.5  # half every step's (normalised) norm here (about 1): every step clips


def test_recipe_fused_clips_through_the_optimizer(tmp_path, initial_weights):
    """The real recipe, accumulation 2, a max_grad_norm that clips every step: fusedopt's recipe with
    fused=True logs the optimizer's norm of each step (before clipping, above max_grad_norm) and the update
    was clipped; torchtune's own clip_grad_norm in the stock recipe with fused=False clips by the same first
    norm (the same gradients) and trains close to it: under release the clipping coefficient comes from a
    one-pass estimate of the global norm (docs/semantics.md, "Clipping"), so only the first norm is equal."""
    opt_norms = []
    ours = _run(
        ft.FullFinetuneRecipeSingleDevice,
        _recipe_config(tmp_path, optimizer={"max_grad_norm": CLIP}),
        on_step=lambda opt, *_: opt_norms.append(opt.grad_norm.clone()),
    )
    assert ours._optimizer.fused and ours._optimizer.accumulation_steps == 2
    logged = torch.stack([r["grad_norm"] for r in ours._metric_logger.records])
    assert len(logged) == 3 and torch.equal(logged, torch.stack(opt_norms))  # the optimizer's, bit for bit
    assert float(logged.min()) > CLIP  # every step clipped

    unclipped = _run(ft.FullFinetuneRecipeSingleDevice, _recipe_config(tmp_path))  # MAX_NORM: never clips
    unclipped_norms = torch.stack([r["grad_norm"] for r in unclipped._metric_logger.records])
    assert float(unclipped_norms.max()) < MAX_NORM
    assert torch.equal(logged[0], unclipped_norms[0])  # the same first gradients
    weights, unclipped_weights = ours._model.state_dict(), unclipped._model.state_dict()
    assert max((weights[n] - unclipped_weights[n]).abs().max().item() for n in weights) > 1e-4  # clipping mattered

    stock = _run(
        ft.StockFullFinetuneRecipeSingleDevice,
        _recipe_config(tmp_path, clip_grad_norm=CLIP, optimizer={"fused": False, "max_grad_norm": None}),
    )
    stock_norms = torch.stack([r["grad_norm"] for r in stock._metric_logger.records])
    torch.testing.assert_close(logged[0], stock_norms[0], rtol=1e-6, atol=0)  # the same gradients, before clipping
    torch.testing.assert_close(logged, stock_norms, rtol=1e-4, atol=0)  # later steps: close (measured 1e-5)

    def distance(a, b):
        return sum(((a[n] - b[n]) ** 2).sum() for n in a).sqrt().item()

    stock_weights = stock._model.state_dict()
    # the estimate's clipping is nearer torch's exact clipping than that is to not clipping (measured 0.55)
    assert distance(weights, stock_weights) < 0.75 * distance(stock_weights, unclipped_weights)


def test_stock_recipe_refuses_a_releasing_optimizer(tmp_path, initial_weights):
    cfg = _recipe_config(tmp_path)
    recipe = ft.StockFullFinetuneRecipeSingleDevice(cfg=cfg)
    with pytest.raises(ValueError, match="fusedopt.integrations.torchtune"):
        recipe.setup(cfg=cfg)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"optimizer": {"accumulation_steps": 3}}, "accumulation_steps=3 differs"),
        ({"clip_grad_norm": 1.0}, "clip_grad_norm"),
        ({"optimizer_in_bwd": True, "gradient_accumulation_steps": 1}, "optimizer_in_bwd"),
    ],
)
def test_recipe_refuses_what_release_cannot_follow(tmp_path, initial_weights, overrides, message):
    cfg = _recipe_config(tmp_path, **overrides)
    recipe = ft.FullFinetuneRecipeSingleDevice(cfg=cfg)
    with pytest.raises(ValueError, match=message):
        recipe.setup(cfg=cfg)


def test_optimizer_in_backward_draws_a_stream_per_parameter(tmp_path, initial_weights):
    """torchtune's optimizer-in-backward builds one seedless fusedopt optimizer per parameter: each takes a
    default seed of its own in construction order (not all seed 0, index 0), saved in its state dict."""
    cfg = _recipe_config(
        tmp_path,
        optimizer_in_bwd=True,
        gradient_accumulation_steps=1,
        max_steps_per_epoch=2,
        optimizer={"fused": False, "max_grad_norm": None},
    )
    recipe = _run(ft.FullFinetuneRecipeSingleDevice, cfg)
    optimizers = list(recipe._optim_ckpt_wrapper.optim_map.values())  # in model.named_parameters() order
    seeds = [opt.seed for opt in optimizers]
    slots = [rng.default_slot(seed) for seed in seeds]
    assert len(optimizers) > 10 and slots == list(range(slots[0], slots[0] + len(optimizers)))
    saved = recipe._optim_ckpt_wrapper.state_dict()
    assert [saved[name]["fusedopt"]["seed"] for name in recipe._optim_ckpt_wrapper.optim_map] == seeds
