"""Small diffusers pipelines built from configs here (no download), saved with `save_pretrained`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def clip_tokenizer(folder: Path) -> Any:
    """A CLIP BPE tokenizer over single letters (vocab.json + merges.txt written here)."""
    from transformers import CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["<|startoftext|>", "<|endoftext|>", "!", *letters, *(c + "</w>" for c in letters)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=16)


def word_tokenizer() -> Any:
    """A word-level fast tokenizer (the T5 encoder's, here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>", "a", "cat", "lighthouse", "at", "dusk"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=16)  # fmt: skip


def clip_text(projection: bool = False) -> Any:
    import transformers

    config = transformers.CLIPTextConfig(bos_token_id=0, eos_token_id=1, hidden_size=32, intermediate_size=37,
                                         num_attention_heads=4, num_hidden_layers=2, pad_token_id=1, vocab_size=60,
                                         projection_dim=32)  # fmt: skip
    return (transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel)(config)


def vae() -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=[32, 64], in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                         norm_num_groups=32, sample_size=32)  # fmt: skip


def stable_diffusion(folder: Path, variant: str | None = None) -> Path:
    """UNet + VAE + CLIP text encoder + tokenizer + DDIM scheduler, as StableDiffusionPipeline saves them."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=4,
                                out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                                norm_num_groups=32)  # fmt: skip
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)  # fmt: skip
    pipe = StableDiffusionPipeline(vae=vae(), text_encoder=clip_text(), tokenizer=clip_tokenizer(folder / "_tok"),
                                   unet=unet, scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)  # fmt: skip
    pipe.save_pretrained(folder)
    if variant:  # its weight files beside the plain ones; the configs stay the plain ones' (float32)
        configs = {f: f.read_bytes() for f in folder.glob("*/config.json")}
        pipe.to(torch.float16).save_pretrained(folder, variant=variant)
        for f, data in configs.items():
            f.write_bytes(data)
    return folder


def flux(folder: Path) -> Path:
    """Flux's transformer + VAE + CLIP and T5 encoders, the transformer saved in shards."""
    import transformers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])  # fmt: skip
    t5 = transformers.T5EncoderModel(transformers.T5Config(vocab_size=8, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                                           num_heads=4, decoder_start_token_id=0))  # fmt: skip
    from diffusers import AutoencoderKL

    vae4 = AutoencoderKL(block_out_channels=[32, 64], in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                         norm_num_groups=32, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
                         shift_factor=0.0609, scaling_factor=1.5035)  # fmt: skip
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae4, text_encoder=clip_text(),
                        tokenizer=clip_tokenizer(folder / "_tok"), text_encoder_2=t5, tokenizer_2=word_tokenizer(),
                        transformer=transformer)  # fmt: skip
    pipe.save_pretrained(folder)
    pipe.transformer.save_pretrained(folder / "transformer", max_shard_size="20KB")  # sharded, with an index
    for f in folder.glob("transformer/diffusion_pytorch_model.safetensors"):
        f.unlink()
    return folder
