"""Action masks: which observation leaf says which actions are legal, and the masked picks.

An env with illegal actions (board games, schedulers) puts a 0/1 vector in a Dict observation
(``MultiBinary(n)`` or a bool ``Box((n,))``, n = the Discrete space's n, or sum(nvec) for a
MultiDiscrete one with each part's entries in order, as sb3-contrib's MaskablePPO lays them
out). ``ModelConfig.action_mask`` names it; the agents then never pick an illegal action:

- policy gradient: illegal logits are replaced by ``MASKED_LOGIT`` before sampling, the
  log-probability and the entropy (so the entropy is over the legal actions only);
- Q agents: the greedy action (acting, and the bootstrap action of DQN's and R2D1's targets)
  is the argmax over legal actions, and epsilon-greedy's random action is uniform over them.

A row with no legal action at all (an env's terminal observation may say so) counts every
action as legal: a pick is still defined and no value turns into -inf or NaN. The mask leaf
stays in the observation the encoder reads, as any other leaf.

Torch-free: the functions take numpy arrays or torch tensors alike (``where`` comes from the
array's own library), so the numpy actor and the torch agents share them.
"""

from __future__ import annotations

import sys

import numpy as np

from shared.data.namedarraytuple import is_nat, leaves

AUTO = "auto"
DEFAULT_KEY = "action_mask"
MASKED_LOGIT = -1e8
"""What an illegal action's logit becomes: exp() of it is exactly 0 in float32 (so is its share
of the entropy, 0 * -1e8), and unlike -inf it gives no NaN anywhere (sb3-contrib uses the same)."""


def _xp(x):
    """numpy for numpy arrays, torch for tensors (torch is loaded when one exists)."""
    return np if isinstance(x, np.ndarray) else sys.modules["torch"]


def mask_path(setting: str, obs_example, n_actions: int | None, obs_space=None) -> str | None:
    """The dotted path of the mask leaf in observations like ``obs_example`` (one observation,
    a namedarraytuple for a Dict space), or None for no masking.

    ``setting`` is ``ModelConfig.action_mask``: "auto" (``action_mask`` where a Dict observation
    has that key, else no masking), "" (never), or a key path that must exist. ``n_actions``:
    the mask's length (None: an action space masks cannot apply to, e.g. Box). ValueError in one
    line naming ``model.action_mask`` for a missing key, a wrong length or a leaf that is not 0/1.
    """
    if not setting:
        return None
    paths = dict(leaves(obs_example)) if is_nat(obs_example) else {}
    path = DEFAULT_KEY if setting == AUTO else setting
    if path not in paths:
        if setting == AUTO:
            return None
        have = ", ".join(paths) if paths else "one array, not a Dict"
        raise ValueError(f"model.action_mask = {setting!r}: the observation has no such key (it has {have}); "
                         "name the mask's key, or set \"\" for no masking")
    if n_actions is None:
        raise ValueError(f"model.action_mask: the observation has a mask {path!r}, but masks need a Discrete or "
                         "MultiDiscrete action space; set model.action_mask = \"\"")
    leaf = np.asarray(paths[path])
    if leaf.shape != (n_actions,):
        raise ValueError(f"model.action_mask: the mask {path!r} has shape {leaf.shape}, the action space needs "
                         f"({n_actions},) (one entry per action)")
    space = _subspace(obs_space, path) if obs_space is not None else None
    if space is not None and not _binary(space):
        raise ValueError(f"model.action_mask: the mask {path!r} is {space}; it must be MultiBinary({n_actions}) "
                         "or a bool Box")
    return path


def _subspace(space, path: str):
    for key in path.split("."):
        spaces = getattr(space, "spaces", None)
        if spaces is None:
            return None
        space = spaces[key] if isinstance(spaces, dict) else spaces[int(key.removeprefix("f"))]
    return space


def _binary(space) -> bool:
    from gymnasium import spaces

    return isinstance(space, spaces.MultiBinary) or (isinstance(space, spaces.Box) and space.dtype == np.bool_)


def legal(obs, path: str | None):
    """bool [*L, A]: the legal actions of observations [*L, ...] (numpy or torch leaves), every
    action of a row whose mask has none; None without a mask (``path`` None)."""
    if path is None:
        return None
    mask = obs
    for key in path.split("."):
        mask = getattr(mask, key)
    mask = mask != 0
    return mask | ~mask.any(-1)[..., None]


def masked(values, ok, fill: float = MASKED_LOGIT):
    """``values`` [*L, A] with the illegal entries (``ok`` False) set to ``fill``; ``values``
    itself where ``ok`` is None."""
    return values if ok is None else _xp(values).where(ok, values, fill)


def masked_argmax(values, ok):
    """argmax over the legal actions of ``values`` [*L, A] -> int64 [*L]."""
    return masked(values, ok, -np.inf).argmax(-1)


def random_legal(uniform, ok):
    """A uniformly random legal action per row [*L] from ``uniform`` [*L, A] draws in [0, 1)."""
    return masked(uniform, ok, -1.0).argmax(-1)
