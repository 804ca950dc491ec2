# The cffi module is generated at build time from llama.cpp's headers; its members are not typed.
from typing import Any

ffi: Any
lib: Any
