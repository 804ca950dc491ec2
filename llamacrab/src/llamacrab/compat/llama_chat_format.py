"""llama-cpp-python's multimodal chat handlers, as llamacrab takes them: ``Llama(path,
chat_handler=Gemma4ChatHandler(clip_model_path=...))`` loads that projector beside the model
(llamacrab's ``mmproj``), and chats take images in ``image_url`` content parts. The prompt is
the model's own chat template (or ``chat_format=``), not a format of the handler's."""

from __future__ import annotations

from pathlib import Path

from llamacrab import InvalidParameterError
from llamacrab._field_types import file_path, path_is


class ProjectorChatHandler:
    """A chat handler of llama-cpp-python's that names a projector (``clip_model_path``)."""

    def __init__(self, clip_model_path: str, verbose: bool = True) -> None:
        # As llama-cpp-python: when it is made (a number or None named, not taken for a file
        # descriptor or a TypeError from os.stat).
        path = file_path("clip_model_path", clip_model_path)
        if not path_is(Path.exists, path, "clip_model_path"):
            raise InvalidParameterError(f"Clip model path does not exist: {clip_model_path}")
        self.clip_model_path = clip_model_path
        self.verbose = verbose


class MTMDChatHandler(ProjectorChatHandler):
    """libmtmd's projectors. llamacrab places a projector as it places the model (on the GPU
    of a GPU build): a Llama given ``use_gpu=False`` refuses it."""

    def __init__(self, clip_model_path: str, verbose: bool = True, use_gpu: bool = True) -> None:
        super().__init__(clip_model_path, verbose)
        self.use_gpu = use_gpu


class Gemma4ChatHandler(MTMDChatHandler):
    pass


class Llava15ChatHandler(ProjectorChatHandler):
    pass


class Llava16ChatHandler(Llava15ChatHandler):
    pass


class ObsidianChatHandler(Llava15ChatHandler):
    pass


class MoondreamChatHandler(Llava15ChatHandler):
    pass


class NanoLlavaChatHandler(Llava15ChatHandler):
    pass


class Llama3VisionAlphaChatHandler(Llava15ChatHandler):
    pass


class MiniCPMv26ChatHandler(Llava15ChatHandler):
    pass


class Qwen25VLChatHandler(Llava15ChatHandler):
    pass
