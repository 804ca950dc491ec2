"""GBNF grammar text bounded and rewritten in pure Python before llama.cpp's grammar parser and
sampler see it: size, nesting and expansion bounds, parse-stack fan-out, and repetitions past
llama.cpp's count limit written so that it enforces them."""
