"""The one check a LoRA adapter passes wherever it enters the store (`create`, a registry pull, an import): a GGUF
LoRA whose every tensor fits the base model's, trained on the base's architecture. An adapter that passes llama.cpp's
own checks but not these aborts the server at its first multiplication, so a misfit is refused before it is stored
under a model's name."""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidInput


def check_adapter_fits(adapter: Path, base: Path, label: str, shown: str) -> None:
    """Refuse an adapter file that does not fit the base model's GGUF weights.

    Args:
        label: the base model as a user names it (in the message).
        shown: the adapter as the user named it (a path, or the layer it came from).
    Raises:
        ModelFormatError (HTTP 400): not a GGUF LoRA, or a tensor whose name, rank or shape does not fit the base.
        InvalidInput: the adapter is for another architecture.
    """
    from ..quant.gguf import check_lora_fits, inspect_gguf, inspect_lora

    lora = inspect_lora(adapter)
    base_info = inspect_gguf(base)
    check_lora_fits(lora, base_info, label)
    family = base_info.architecture
    if family and lora.architecture != family:
        raise InvalidInput(
            f"adapter {shown!r} is for {lora.architecture or 'an unknown architecture'}, but {label} is {family}",
            hint="use an adapter trained on this base model",
        )
