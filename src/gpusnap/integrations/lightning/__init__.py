"""Lightning: ``Trainer(plugins=[GpusnapCheckpointIO()])`` (``pip install 'gpusnap[lightning]'``).

See docs/integrations/lightning.md.
"""

from gpusnap.integrations import require

require("lightning", "lightning")

from .checkpoint_io import RNG_KEY, ROOT_NAME, GpusnapCheckpointIO, resolve  # noqa: E402
from .loading import load_from_checkpoint  # noqa: E402
from .pointer import Pointer  # noqa: E402

__all__ = ["GpusnapCheckpointIO", "Pointer", "RNG_KEY", "ROOT_NAME", "load_from_checkpoint", "resolve"]
