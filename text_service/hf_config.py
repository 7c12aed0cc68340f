"""Read a checkpoint's config.json into the (read-only) HF text-model config."""

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """The text-model config of an HF-format directory (no network).

    An image-text Qwen3.5 checkpoint (model_type ``qwen3_5``) yields its ``text_config``, with the
    top-level ``tie_word_embeddings`` that such checkpoints keep outside the text config.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir} has no config.json: expected an HF-format model directory"
        )
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if config.model_type == "qwen3_5":
        text = config.text_config.to_dict()
        text["tie_word_embeddings"] = config.tie_word_embeddings
        config = type(config.text_config).from_dict(text)
    return config
