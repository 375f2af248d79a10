"""Hugging Face ``Trainer``: ``callbacks=[GpusnapCallback(root, save_steps=N)]`` and
``trainer.train(resume_from_checkpoint=callback.resume_path())``
(``pip install 'gpusnap[transformers]'``). See docs/integrations/transformers.md.
"""

from gpusnap.integrations import require

require("transformers", "transformers")

from .callback import GpusnapCallback  # noqa: E402
from .hf_layout import write_resume_dir  # noqa: E402

__all__ = ["GpusnapCallback", "write_resume_dir"]
