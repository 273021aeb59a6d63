"""Observation encoders: any (nested) observation to one feature vector per sample.

``make_encoder(obs_example, cfg)`` builds a module that flattens and concatenates the
leaves of an observation tree (image leaves go through a Nature CNN, or MinAtar's one-layer
CNN, first) and runs the result through an MLP trunk. Agents put their heads on top of it. Initialisation follows
CleanRL: orthogonal weights, zero biases, gain sqrt(2) for hidden layers.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shared.agents.config import ModelConfig
from shared.data.namedarraytuple import is_nat, leaves, map_leaves
from shared.envs.pettingzoo_backend import GROUP_KEY
from shared.runtime.plugins import is_reference, load_attribute

_ACTIVATIONS = {"tanh": (nn.Tanh, torch.tanh), "relu": (nn.ReLU, torch.relu)}  # keys: agent_config.ACTIVATIONS
HIDDEN_GAIN = math.sqrt(2.0)


def obs_to(obs, device: torch.device, norm: "ObsNorm | None" = None):
    """An observation tree (numpy or torch leaves) as torch tensors on ``device``, normalised
    by ``norm`` when the agent has one."""
    obs = map_leaves(lambda x: torch.as_tensor(x).to(device, non_blocking=True), obs)
    return obs if norm is None else norm(obs)


class ObsNorm(nn.Module):
    """(x - mean) / sqrt(var + 1e-8), clipped to +-clip, for one float observation array.

    ``count``, ``mean`` and ``var`` (float64) are buffers: part of the agent's state_dict, so
    they travel with every parameter version and into checkpoints. ``update`` merges the
    sums ``shared.data.obs_stats.Moments`` collected from inserted segments.
    """

    def __init__(self, shape: tuple[int, ...], clip: float) -> None:
        super().__init__()
        self.clip = clip
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(shape, dtype=torch.float64))
        self.register_buffer("var", torch.ones(shape, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean.float()) * torch.rsqrt(self.var.float() + 1e-8)).clamp(-self.clip, self.clip)

    @torch.no_grad()
    def update(self, obs_count: int, obs_sum, obs_sumsq) -> None:
        from shared.data.obs_stats import merge

        shape = self.mean.shape
        count, mean, var = merge(self.count.item(), self.mean.cpu().numpy().reshape(-1),
                                 self.var.cpu().numpy().reshape(-1), obs_count, np.asarray(obs_sum),
                                 np.asarray(obs_sumsq))
        self.count.fill_(count)
        self.mean.copy_(torch.as_tensor(mean).reshape(shape))
        self.var.copy_(torch.as_tensor(var).reshape(shape))


def make_obs_norm(obs_example, cfg: ModelConfig) -> ObsNorm | None:
    """The agent's observation normaliser, or None without ``cfg.normalize_observations``.
    ValueError for observations it cannot normalise (trees, integer arrays)."""
    if not cfg.normalize_observations:
        return None
    arr = obs_example if isinstance(obs_example, np.ndarray) else None
    if arr is None or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError("model.normalize_observations needs observations that are one float array, got "
                         f"{type(obs_example).__name__}" + (f" of {arr.dtype}" if arr is not None else ""))
    return ObsNorm(tuple(arr.shape), cfg.obs_clip)


def init_layer(layer: nn.Module, gain: float = HIDDEN_GAIN) -> nn.Module:
    """Orthogonal weights with ``gain``, zero bias (CleanRL's ``layer_init``)."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


class CosineEmbedding(nn.Module):
    """IQN's embedding of quantile fractions (Dabney et al. 2018, eq. 4):
    phi_j(tau) = ReLU(sum_{i=0}^{n-1} cos(pi i tau) w_ij + b_j), tau [*L] -> [*L, out_dim]."""

    def __init__(self, n_cosines: int, out_dim: int) -> None:
        super().__init__()
        self.register_buffer("frequencies", math.pi * torch.arange(n_cosines, dtype=torch.float32))
        self.linear = init_layer(nn.Linear(n_cosines, out_dim))

    def forward(self, taus: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(torch.cos(taus.unsqueeze(-1) * self.frequencies)))


class MLP(nn.Module):
    """Fully connected layers ``in_dim -> hidden_sizes...``, each followed by the activation
    (with ``layer_norm``, by a LayerNorm and then the activation, as PQN's Q-network).

    ``output_size`` adds a final linear layer (no activation) initialised with
    ``output_gain``. ``norm(width)``, when given, makes a layer over [N, width] (``BatchRenorm``
    of one member) that runs before every linear layer, the first and the output's included
    (CrossQ's actor). Input [N, in_dim] -> output [N, out_dim].
    """

    def __init__(
        self,
        in_dim: int,
        hidden_sizes: tuple[int, ...],
        activation: str = "tanh",
        output_size: int | None = None,
        output_gain: float = 1.0,
        layer_norm: bool = False,
        norm: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        module, fn = _ACTIVATIONS[activation]
        # plan: (linear, activation or None) in order; forward calls them directly, since the
        # module-call machinery costs more than a small layer's matmul (the sampler's hot path).
        # norms: the LayerNorm after each plan entry's linear layer, or None; pre_norms: the
        # ``norm`` layer before it, or None.
        self.plan: list[tuple[nn.Linear, object]] = []
        self.norms: list[nn.LayerNorm | None] = []
        self.pre_norms: list[nn.Module | None] = []
        last = in_dim
        for width in hidden_sizes:
            self.pre_norms.append(norm(last) if norm is not None else None)
            if norm is not None:
                layers.append(self.pre_norms[-1])
            layers.append(init_layer(nn.Linear(last, width)))
            self.plan.append((layers[-1], fn))
            if layer_norm:
                layers.append(nn.LayerNorm(width))
            self.norms.append(layers[-1] if layer_norm else None)
            layers.append(module())
            last = width
        if output_size is not None:
            self.pre_norms.append(norm(last) if norm is not None else None)
            if norm is not None:
                layers.append(self.pre_norms[-1])
            layers.append(init_layer(nn.Linear(last, output_size), output_gain))
            self.plan.append((layers[-1], None))
            self.norms.append(None)
            last = output_size
        self.net = nn.Sequential(*layers)  # owns the parameters (state_dict keys net.<i>.weight)
        self.out_dim = last

    @property
    def device(self) -> torch.device:
        """Where the first layer's weight lives (cheap: agents ask on every step)."""
        if not self.plan:  # an empty trunk: AttributeError, as hasattr() probes expect (torch.jit.trace's)
            raise AttributeError("an MLP without layers has no device")
        return self.plan[0][0].weight.device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for (linear, fn), norm, pre in zip(self.plan, self.norms, self.pre_norms):
            if pre is not None:
                x = pre(x)
            x = F.linear(x, linear.weight, linear.bias)
            if norm is not None:
                x = F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
            if fn is not None:
                x = fn(x)
        return x


class BatchRenorm(nn.Module):
    """Batch renormalization (Ioffe 2017) of each ensemble member's features [n, N, width]:
    per member and feature, over the N samples, as CrossQ's critics and actor use it (Bhatt et
    al. 2024; sb3-contrib's BatchRenorm1d, with its defaults). With n = 1 it also takes one
    network's features [N, width] (``MLP``'s ``norm``).

    Training: x_hat = (x - mu_B) / sigma_B * r + d, with sigma_B = sqrt(var_B + eps) the batch's
    (biased) statistics, r = sigma_B / sigma and d = (mu_B - mu) / sigma from the running
    statistics (mu, sigma = sqrt(var + eps)), held constant in the gradient and clipped to
    [1/R_MAX, R_MAX] and [-D_MAX, D_MAX]; during the first ``warmup_steps`` training passes r = 1,
    d = 0 (batch norm). The running statistics then move: mu <- mu + momentum (mu_B - mu), var
    likewise. Evaluation (``eval()``): x_hat = (x - mu) / sigma. Output scale * x_hat + bias,
    both learned, one per member and feature. The pass count is a buffer, so a resumed run goes
    on where it was.
    """

    R_MAX, D_MAX = 3.0, 5.0

    def __init__(self, n: int, width: int, momentum: float, eps: float, warmup_steps: int) -> None:
        super().__init__()
        self.momentum, self.eps, self.warmup_steps = momentum, eps, warmup_steps
        self.scale = nn.Parameter(torch.ones(n, 1, width))
        self.bias = nn.Parameter(torch.zeros(n, 1, width))
        self.register_buffer("running_mean", torch.zeros(n, 1, width))
        self.register_buffer("running_var", torch.ones(n, 1, width))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # one network's features [N, width] (the actor's): a one-member ensemble
            return self._normalise(x[None])[0]
        return self._normalise(x)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            var, mean = torch.var_mean(x, dim=1, keepdim=True, unbiased=False)
            std = (var + self.eps).sqrt()
            with torch.no_grad():
                running_std = (self.running_var + self.eps).sqrt()
                # A tensor condition, not a Python branch: no device sync each pass.
                renorm = self.steps >= self.warmup_steps
                r = torch.where(renorm, (std / running_std).clamp(1.0 / self.R_MAX, self.R_MAX), 1.0)
                d = torch.where(renorm, ((mean - self.running_mean) / running_std).clamp(-self.D_MAX, self.D_MAX), 0.0)
                self.running_mean.lerp_(mean, self.momentum)
                self.running_var.lerp_(var, self.momentum)
                self.steps += 1
            a = r / std  # (x - mean) / std * r + d = x * a + b: one multiply-add on x (as torch's batch_norm)
            b = d - mean * a
        else:
            a = torch.rsqrt(self.running_var + self.eps)
            b = -self.running_mean * a
        return torch.addcmul(self.bias + self.scale * b, x, self.scale * a)


class EnsembleMLP(nn.Module):
    """``n`` independent MLPs of one shape run as one: each layer is a batched matmul
    (``torch.baddbmm``) over weights [n, in, out], so twin critics cost one critic's kernel
    launches, which is what small networks on a CPU pay for. Each member is initialised
    like ``MLP`` (orthogonal, gain sqrt(2) for hidden layers, ``output_gain`` for the last:
    one for all members, or one each). ``norm(width)``, when given, makes a layer over
    [n, N, width] (``BatchRenorm``) that runs before every linear layer, the first included.
    Input [n, N, in_dim] -> output [n, N, out_dim].
    """

    def __init__(self, n: int, in_dim: int, hidden_sizes: tuple[int, ...], activation: str = "tanh",
                 output_size: int = 1, output_gain: float | tuple[float, ...] = 1.0,
                 norm: Callable[[int], nn.Module] | None = None) -> None:
        super().__init__()
        self.fn = _ACTIVATIONS[activation][1]
        self.weights, self.biases = nn.ParameterList(), nn.ParameterList()
        sizes = [in_dim, *hidden_sizes, output_size]
        out_gains = output_gain if isinstance(output_gain, tuple) else (output_gain,) * n
        if len(out_gains) != n:
            raise ValueError(f"EnsembleMLP: {len(out_gains)} output gains for {n} members")
        for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            gains = out_gains if k == len(sizes) - 2 else (HIDDEN_GAIN,) * n
            members = [nn.init.orthogonal_(torch.empty(b, a), gain).T for gain in gains]  # nn.Linear's [out, in], transposed
            self.weights.append(nn.Parameter(torch.stack(members)))
            self.biases.append(nn.Parameter(torch.zeros(n, 1, b)))
        self.norms = nn.ModuleList([norm(a) for a in sizes[:-1]]) if norm is not None else None
        self.out_dim = output_size

    @property
    def device(self) -> torch.device:
        return self.weights[0].device

    def member(self, m: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``m`` alone on input [*L, in_dim] -> [*L, out_dim] (the others' work skipped)."""
        if self.norms is not None:  # its statistics are over the whole ensemble's batch
            raise ValueError("EnsembleMLP.member: not for an ensemble with normalization layers")
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        last = len(self.weights) - 1
        for k, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = torch.addmm(b[m], x, w[m])
            if k < last:
                x = self.fn(x)
        return x.reshape(*lead, x.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.weights) - 1
        for k, (w, b) in enumerate(zip(self.weights, self.biases)):
            if self.norms is not None:
                x = self.norms[k](x)
            x = torch.baddbmm(b, x, w)
            if k < last:
                x = self.fn(x)
        return x


class NatureCNN(nn.Module):
    """Mnih et al. (2015) torso: 32x8x8/4, 64x4x4/2, 64x3x3/1, fc 512, relu throughout.

    Input [N, C, H, W] (or [N, H, W, C] with ``channels_last``), multiplied by ``scale``.
    Output [N, 512]. Images need H, W >= ``MIN_SIDE`` for the three kernels to fit.
    """

    MIN_SIDE = 36  # 36 -> 8 -> 3 -> 1

    def __init__(self, image_shape: tuple[int, ...], channels_last: bool, scale: float = 1.0 / 255.0) -> None:
        super().__init__()
        self.channels_last, self.scale = channels_last, scale
        c, h, w = _chw(image_shape, channels_last)
        if min(h, w) < self.MIN_SIDE:
            raise ValueError(f"model.encoder: a {h}x{w} image is smaller than the Nature CNN's "
                             f"{self.MIN_SIDE}x{self.MIN_SIDE} minimum; use encoder = \"auto\" or \"mlp\"")
        self.conv = nn.Sequential(
            init_layer(nn.Conv2d(c, 32, 8, stride=4)),
            nn.ReLU(),
            init_layer(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            init_layer(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, c, h, w)).shape[1]
        self.fc = nn.Sequential(init_layer(nn.Linear(flat, 512)), nn.ReLU())
        self.out_dim = 512

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.permute(0, 3, 1, 2)
        return self.fc(self.conv(x.float() * self.scale))


class MinAtarCNN(nn.Module):
    """Young & Tian (2019), MinAtar's torso: 16 filters 3x3, stride 1, no padding, relu, flattened.

    Input [N, H, W, C] channels last (MinAtar's maps; C is 4 to 10 by game, so the
    ``channels_last`` guess of the Nature CNN cannot tell), multiplied by ``scale`` (1.0 for
    0/1 maps). Output [N, 16 (H - 2) (W - 2)]: 1024 on 10x10. The paper's 128-unit hidden
    layer is the encoder's trunk, ``model.hidden_sizes = [128]`` with ``activation = "relu"``.
    """

    FILTERS = 16

    def __init__(self, image_shape: tuple[int, ...], scale: float) -> None:
        super().__init__()
        self.scale = scale
        h, w, c = image_shape
        if min(h, w) < 3:
            raise ValueError(f"model.encoder: a {h}x{w}x{c} map is smaller than minatar_cnn's 3x3 kernel")
        self.conv = init_layer(nn.Conv2d(c, self.FILTERS, 3, stride=1))
        self.out_dim = self.FILTERS * (h - 2) * (w - 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(_channels_first(x, self.scale))).flatten(1)


def _channels_first(maps: torch.Tensor, scale: float) -> torch.Tensor:
    """[N, H, W, C] maps -> float [N, C, H, W], multiplied by ``scale`` (the map CNNs' input)."""
    x = maps.permute(0, 3, 1, 2).float()
    return x if scale == 1.0 else x * scale


class BoardCNN(nn.Module):
    """Three 3x3 conv layers of 32 filters, stride 1, same padding, relu each, flattened: a unit
    of the last layer sees 7x7 cells, a whole line of four on a Connect Four board, where
    ``MinAtarCNN``'s one layer sees 3x3 (docs/benchmarks.md, "Connect Four: what the self-play policy
    misses", its probe of a deeper board network).
    Input [N, H, W, C] channels last, multiplied by ``scale``; output [N, 32 H W]."""

    FILTERS, LAYERS = 32, 3

    def __init__(self, image_shape: tuple[int, ...], scale: float) -> None:
        super().__init__()
        self.scale = scale
        h, w, c = image_shape
        layers: list[nn.Module] = []
        for i in range(self.LAYERS):
            layers += [init_layer(nn.Conv2d(c if i == 0 else self.FILTERS, self.FILTERS, 3, padding=1)), nn.ReLU()]
        self.conv = nn.Sequential(*layers, nn.Flatten())
        self.out_dim = self.FILTERS * h * w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(_channels_first(x, self.scale))


MAP_CNNS = {"minatar_cnn": MinAtarCNN, "board_cnn": BoardCNN}
"""The CNNs of channels-last [H, W, C] maps by ``model.encoder`` name; ``nature_cnn`` is the other."""
CNN_ENCODERS = ("nature_cnn", *MAP_CNNS)
"""The encoders that put every 3-D leaf through a CNN (``auto`` only large uint8 images)."""


class _Flatten(nn.Module):
    """One non-image leaf [N, ...] -> float32 [N, prod(shape)], multiplied by ``scale``."""

    def __init__(self, shape: tuple[int, ...], scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.out_dim = int(np.prod(shape, dtype=np.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], self.out_dim).float()
        return x if self.scale == 1.0 else x * self.scale


class OneHot(nn.Module):
    """A Discrete or MultiDiscrete leaf [N, *shape] of ints -> float32 one-hots [N, sum(nvec)],
    each entry's categories in order (SB3's ``preprocess_obs``): Discrete(16)'s state 5 is
    unit vector e_5, not the scalar 5. ``nvec`` and ``start`` are the space's, one per entry
    (an int64 scalar leaf is one entry); values are the env's, ``start`` included."""

    def __init__(self, nvec: np.ndarray, start: np.ndarray) -> None:
        super().__init__()
        nvec = np.asarray(nvec, np.int64).reshape(-1)
        start = np.array(np.broadcast_to(np.asarray(start, np.int64), nvec.shape)).reshape(-1)
        self.out_dim = int(nvec.sum())
        first = np.concatenate([[0], np.cumsum(nvec)[:-1]])  # each entry's first column
        self.register_buffer("first", torch.as_tensor(first, dtype=torch.int64), persistent=False)
        self.register_buffer("top", torch.as_tensor(nvec - 1, dtype=torch.int64), persistent=False)
        self.register_buffer("start", torch.as_tensor(start, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1).long()
        # out-of-range values (none from EnvGroup, which checks them) land on the nearest category
        index = (x - self.start).clamp(min=0).minimum(self.top) + self.first
        return torch.zeros(x.shape[0], self.out_dim, device=x.device).scatter_(1, index, 1.0)


def discrete_leaves(obs_space) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Per observation leaf, in ``leaves()`` order (Dict keys sorted, Tuple in order, as
    ``shared.envs.group`` lays them out): (nvec, start) of a Discrete or MultiDiscrete space,
    None for any other."""
    from gymnasium import spaces

    if isinstance(obs_space, spaces.Dict):
        return [leaf for key in sorted(obs_space.spaces) for leaf in discrete_leaves(obs_space.spaces[key])]
    if isinstance(obs_space, spaces.Tuple):
        return [leaf for sub in obs_space.spaces for leaf in discrete_leaves(sub)]
    if isinstance(obs_space, spaces.Discrete):
        return [(np.array([obs_space.n]), np.array([obs_space.start]))]
    if isinstance(obs_space, spaces.MultiDiscrete):
        return [(obs_space.nvec, getattr(obs_space, "start", np.zeros_like(obs_space.nvec)))]
    return [None]


class Encoder(nn.Module):
    """Observation tree with any leading dims [*L, ...] -> features [*L, out_dim].

    Built by ``make_encoder``; leaves are read in the tree's field order (depth first),
    each by its own part (``NatureCNN``, ``MinAtarCNN`` or flatten), concatenated, then the MLP trunk.
    Leaves under a path of ``skip`` are not read (they may also be None or absent).
    """

    def __init__(self, leaf_shapes: list[tuple[int, ...]], parts: list[nn.Module], trunk: MLP,
                 leaf_paths: list[str] | None = None, skip: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.leaf_shapes = leaf_shapes
        self.leaf_paths = leaf_paths or [""] * len(parts)
        """Each read leaf's dotted path in the observation tree ("" for a single array)."""
        self.skip = skip
        self.parts = nn.ModuleList(parts)
        self.trunk = trunk
        self.out_dim = trunk.out_dim
        # One vector leaf taken as is (classic control): a float32 [N, d] batch goes straight
        # to the trunk, skipping the per-leaf machinery on the acting hot path.
        self.vector_only = (len(parts) == 1 and isinstance(parts[0], _Flatten) and parts[0].scale == 1.0
                             and len(leaf_shapes[0]) == 1 and not skip)

    def flat_inputs(self) -> list[tuple[str, float]] | None:
        """(path, scale) of each leaf when every one is flattened as is (no CNN, no one-hot):
        the features are then a plain concatenation, which the numpy actor can compute."""
        if not all(isinstance(p, _Flatten) for p in self.parts):
            return None
        return [(path, p.scale) for path, p in zip(self.leaf_paths, self.parts)]

    def forward(self, obs) -> torch.Tensor:
        if self.vector_only and isinstance(obs, torch.Tensor) and obs.dim() == 2 and obs.dtype == torch.float32:
            return self.trunk(obs)
        xs = [x for path, x in leaves(obs) if not _under(path, self.skip)] if self.skip else \
            [x for _, x in leaves(obs)]
        if len(xs) != len(self.parts):
            raise ValueError(f"Encoder: observation has {len(xs)} leaves, expected {len(self.parts)}")
        lead = xs[0].shape[: xs[0].dim() - len(self.leaf_shapes[0])]
        n = math.prod(lead)
        feats = [part(x.reshape(n, *shape)) for part, x, shape in zip(self.parts, xs, self.leaf_shapes)]
        out = self.trunk(torch.cat(feats, dim=-1) if len(feats) > 1 else feats[0])
        return out.reshape(*lead, self.out_dim)


def _under(path: str, tops: tuple[str, ...]) -> bool:
    """Whether the dotted ``path`` is one of ``tops`` or lies under one."""
    return any(path == top or path.startswith(top + ".") for top in tops)


def _is_image(arr: np.ndarray, encoder: str) -> bool:
    """Whether a leaf goes through a CNN: every 3-D leaf for the ``CNN_ENCODERS``; for "auto"
    only uint8 images big enough for the Nature CNN (smaller ones are flattened)."""
    if encoder == "mlp" or arr.ndim != 3:
        return False
    if encoder in CNN_ENCODERS:
        return True
    _, h, w = _chw(arr.shape, _channels_last(arr.shape))
    return arr.dtype == np.uint8 and min(h, w) >= NatureCNN.MIN_SIDE


def _chw(shape: tuple[int, ...], channels_last: bool) -> tuple[int, int, int]:
    return (shape[2], shape[0], shape[1]) if channels_last else tuple(shape)


def _channels_last(shape: tuple[int, ...]) -> bool:
    # Gymnasium/ALE RGB frames are [H, W, C] with C in {1, 3, 4}; frame stacks are [C, H, W].
    return shape[-1] <= 4 < shape[0]


def has_cnn(obs_example, cfg: ModelConfig) -> bool:
    """Whether ``make_encoder`` gives observations like ``obs_example`` learned parameters
    before the trunk: a CNN, or the user's own encoder."""
    if is_reference(cfg.encoder):
        return True
    return any(_is_image(np.asarray(leaf), cfg.encoder) for _, leaf in leaves(obs_example))


class CustomEncoder(nn.Module):
    """The user's encoder (``model.encoder = "module:attribute"``) with the MLP trunk on top.

    ``module:attribute`` names a callable ``make(obs_example, cfg) -> nn.Module`` (a module
    class qualifies): ``obs_example`` is one observation (numpy, or a namedarraytuple of them),
    ``cfg`` the run's ``ModelConfig``; the module maps the observation tree with any leading
    dims [*L, ...] (torch tensors, uint8 leaves unscaled) to features [*L, out_dim] and has an
    int attribute ``out_dim``. The trunk is ``model.hidden_sizes`` on those features, as after
    the built-in encoders (``hidden_sizes = []`` for none).
    """

    def __init__(self, obs_example, cfg: ModelConfig) -> None:
        super().__init__()
        make = load_attribute(cfg.encoder, "model.encoder")
        if not callable(make):
            raise ValueError(f"model.encoder = {cfg.encoder!r}: {type(make).__name__} is not callable")
        self.body = make(obs_example, cfg)
        width = getattr(self.body, "out_dim", None)
        if not isinstance(self.body, nn.Module) or not isinstance(width, int) or width < 1:
            raise ValueError(f"model.encoder = {cfg.encoder!r}: must build a torch.nn.Module with an int out_dim >= 1 "
                             f"(got {type(self.body).__name__}, out_dim = {width!r})")
        self.trunk = MLP(width, tuple(cfg.hidden_sizes), cfg.activation, layer_norm=cfg.layer_norm)
        self.out_dim = self.trunk.out_dim
        self.vector_only = False

    def forward(self, obs) -> torch.Tensor:
        return self.trunk(self.body(obs))


def make_encoder(obs_example, cfg: ModelConfig, obs_space=None,
                 norm: Callable[[int], nn.Module] | None = None, skip: tuple[str, ...] = ()) -> tuple[nn.Module, int]:
    """Encoder for observations shaped like ``obs_example`` and its feature width.

    ``obs_example`` is ONE observation (no leading dims): a numpy array or a nested
    namedarraytuple of them. The module maps a torch tree with leading dims [*L] to
    float32 features [*L, out_dim]. Floats (and ints, bools) are flattened as is, uint8
    leaves scaled by ``cfg.uint8_scale``; image leaves ([H, W, C] or [C, H, W], see ``ModelConfig.encoder``)
    go through a ``NatureCNN`` first, or with ``encoder = "minatar_cnn"`` or ``"board_cnn"``
    ([H, W, C] leaves) a ``MinAtarCNN`` or ``BoardCNN``. With ``hidden_sizes=()`` out_dim is the
    width of the concatenation (512 per Nature CNN leaf, as in CleanRL's Atari agents; 16 (H - 2)
    (W - 2) per MinAtar CNN leaf, 32 H W per board CNN leaf).
    ``cfg.encoder`` may name the user's own encoder as ``module:attribute`` (``CustomEncoder``).

    ``obs_space``, the env's gymnasium observation space, tells which leaves are Discrete or
    MultiDiscrete: those are one-hot encoded (``OneHot``: a category is not a magnitude).
    Without it every int leaf is taken as a number.

    ``norm``: the trunk's layer before each of its linear layers (``MLP``'s ``norm``).
    ``skip``: key paths of leaves the encoder does not read (a policy's, of the value's
    ``global_state``); the module then takes trees with or without them. No encoder reads an
    ``agent_group`` leaf (``env.groups``): it picks the row's networks (``shared.agents.groups``),
    it is no feature.
    """
    if is_nat(obs_example) and GROUP_KEY in obs_example._fields:
        skip = (*skip, GROUP_KEY)
    if is_reference(cfg.encoder):
        if norm is not None:
            raise ValueError(f"model.encoder = {cfg.encoder!r}: batch renorm in the actor (algo.actor_batch_renorm) "
                             "needs a built-in encoder, whose trunk it normalises; set it false")
        if skip:
            raise ValueError(f"model.encoder = {cfg.encoder!r}: a policy that must not read {', '.join(skip)} "
                             "needs a built-in encoder (yours reads the whole observation)")
        encoder = CustomEncoder(obs_example, cfg)
        return encoder, encoder.out_dim
    shapes: list[tuple[int, ...]] = []
    parts: list[nn.Module] = []
    example = list(leaves(obs_example))
    discrete = discrete_leaves(obs_space) if obs_space is not None else [None] * len(example)
    if len(discrete) != len(example):
        raise ValueError(f"make_encoder: the observation space has {len(discrete)} leaves, the example {len(example)}")
    for (path, leaf), categories in zip(example, discrete):
        if _under(path, skip):
            continue
        arr = np.asarray(leaf)
        shape, scale = tuple(arr.shape), cfg.uint8_scale if arr.dtype == np.uint8 else 1.0
        shapes.append(shape)
        if categories is not None:
            parts.append(OneHot(*categories))
        elif _is_image(arr, cfg.encoder):
            map_cnn = MAP_CNNS.get(cfg.encoder)
            parts.append(map_cnn(shape, scale) if map_cnn else NatureCNN(shape, _channels_last(shape), cfg.uint8_scale))
        else:
            parts.append(_Flatten(shape, scale))
    if not parts:
        raise ValueError("make_encoder: obs_example has no array leaves")
    if cfg.encoder in CNN_ENCODERS and not any(isinstance(p, (NatureCNN, *MAP_CNNS.values())) for p in parts):
        raise ValueError(f"ModelConfig.encoder='{cfg.encoder}' needs a 3-D image leaf in the observation")
    in_dim = sum(p.out_dim for p in parts)
    trunk = MLP(in_dim, tuple(cfg.hidden_sizes), cfg.activation, layer_norm=cfg.layer_norm, norm=norm)
    encoder = Encoder(shapes, parts, trunk, [path for path, _ in example if not _under(path, skip)], skip)
    return encoder, encoder.out_dim
