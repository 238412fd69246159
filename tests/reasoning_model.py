"""A reasoning model for the thinking tests: smollm2's weights and tokenizer, written again with the gguf package under
a reasoning chat template (Qwen3's `enable_thinking` switch, DeepSeek-R1's open `<think>` in the generation prompt).

No small reasoning model ships offline. Under this template the real model answers inside an open think block; a
structured-output request on it gets the thinking grammar, and a logit bias on `</` closes the block after its first
token, so the tags and the answer after them come out deterministically."""

from __future__ import annotations

from pathlib import Path

REASONING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


def write_reasoning_gguf(src: Path, dst: Path, template: str = REASONING_TEMPLATE) -> Path:
    """A copy of the GGUF `src` whose chat template is `template`; tensors are copied as they are (quantized)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "tokenizer.chat_template"):
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.add_chat_template(template)
    for tensor in reader.tensors:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return dst


def token_id(path: Path, text: str) -> int:
    """The id of the vocabulary entry spelled exactly `text` (GPT-2 byte spelling, as smollm2's tokenizer has)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    return tokens.index(text)
