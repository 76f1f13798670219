"""The real-engine tests' shim for a vLLM CPU install without torchvision (PyPI has no CPU build of it).

transformers keeps a PIL twin of Qwen2-VL's image processor and falls back to it without torchvision, but vLLM
imports `smart_resize` from the torchvision module, and the Qwen2-VL processor loads a video processor, which
needs torchvision. Here the torchvision module's name is served by its PIL twin (the same smart_resize), and the
processor is given a stand-in video processor that names the video kwargs and processes nothing (the tests send
no video). Loaded as `sitecustomize` through PYTHONPATH, so every process the engine spawns has it too.
"""

import importlib
import importlib.abc
import importlib.util
import sys

_ALIASES = {"transformers.models.qwen2_vl.image_processing_qwen2_vl":
            "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in _ALIASES:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(_ALIASES[spec.name])

    def exec_module(self, module):
        pass


def _install():
    if importlib.util.find_spec("torchvision") is not None:
        return
    sys.meta_path.insert(0, _Alias())
    from transformers import processing_utils
    from transformers.utils import PushToHubMixin

    class NoVideo(PushToHubMixin):
        """Stands in for the video processor: names the video kwargs, processes no video."""

        valid_kwargs = processing_utils.VideosKwargs

        def to_dict(self):
            return {}

    class NoVideoLoader:
        @staticmethod
        def from_pretrained(*args, **kwargs):
            return NoVideo()

    # transformers has no hook for either: its methods are patched in place, which mypy otherwise refuses.
    mapping = processing_utils._LazyAutoProcessorMapping
    get = mapping.__getitem__
    mapping.__getitem__ = (  # type: ignore[method-assign]
        lambda self, key: NoVideoLoader if key == "video_processor" else get(self, key))
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def _check(self, argument_name, argument):
        return NoVideo if isinstance(argument, NoVideo) else check(self, argument_name, argument)

    processing_utils.ProcessorMixin.check_argument_for_proper_class = _check  # type: ignore[method-assign]


_install()
