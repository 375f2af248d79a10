"""Import and export: gpusnap checkpoints to and from safetensors, ``torch.save`` files, DCP
directories and Hugging Face model directories (docs/interop.md).

>>> import gpusnap
>>> gpusnap.export is export and gpusnap.import_ is import_
True
"""

from gpusnap.interop.errors import FormatError
from gpusnap.interop.exporter import FORMATS, export
from gpusnap.interop.importer import import_
from gpusnap.interop.report import ExportReport

__all__ = ["FORMATS", "ExportReport", "FormatError", "export", "import_"]
