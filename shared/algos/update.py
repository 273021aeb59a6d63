"""What one update of an algorithm returns: its diagnostics and, for prioritized tables, new priorities."""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np


class Update(NamedTuple):
    stats: dict[str, float]
    """Diagnostics by term (losses, norms, lr...): TensorBoard's ``algo/<term>``, the
    ``rlpipe_learner_loss{term=...}`` metric, their means over a progress row."""
    priorities: Optional[np.ndarray] = None
    """float32 [n] >= 0, one per item of the batch, for a prioritized table (the learner sends
    them back to replay); None where the table keeps none."""
