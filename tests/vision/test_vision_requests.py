"""Images on the request path (webchat.serve.images through LocalPreparer) on the SmolVLM-shaped fixture: the image
parts decoded and planned, the template's markers written out as slots, each image's runs found in the prompt;
hostile and unreadable images refused by name, naming the part; the page's trimming keeps the kept images' slots."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image as PILImage

from bench import vision_fidelity as vf
from tests.vision.pictures import picture, png_declaring
from webchat.engine.settings import SamplingSettings
from webchat.serve.images import MAX_IMAGES, load_vision
from webchat.serve.requests import LocalPreparer, Prepared, RequestError, Turn
from webchat.text.tokenizer import Tokenizer

TEXT = "What is in this picture?"


@pytest.fixture(scope="module")
def tokenizer(smolvlm: Any) -> Tokenizer:
    from webchat.files.gguf_cache import model_folder

    return Tokenizer.from_dir(model_folder(smolvlm.text_gguf))


@pytest.fixture(scope="module")
def prep(smolvlm: Any, tokenizer: Tokenizer) -> Iterator[LocalPreparer]:
    vision = load_vision(smolvlm.mmproj_f16, 576, tokenizer)
    yield LocalPreparer(tokenizer, tokenizer.vocab_size, 8192, "none", ["none"], vision)


def url(pil: PILImage.Image, fmt: str = "PNG", **save: Any) -> str:
    buf = io.BytesIO()
    pil.save(buf, fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def user(*parts: dict[str, Any] | str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}


def image(data_url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image", "url": data_url, **extra}


def chat(prep: LocalPreparer, messages: list[dict[str, Any]], fit: bool = False, **turn: Any) -> Prepared:
    return asyncio.run(prep.chat(Turn(messages=messages, settings=lambda _: SamplingSettings(), max_new_tokens=8,
                                      fit=fit, **turn)))


def refused(prep: LocalPreparer, messages: list[dict[str, Any]], **turn: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        chat(prep, messages, **turn)
    return info.value


def test_the_prompt_is_the_processors_and_each_run_is_found(prep: LocalPreparer, smolvlm: Any) -> None:
    from transformers import AutoProcessor

    pil = picture(2048, 512, 1)
    request = chat(prep, [user(image(url(pil)), TEXT)]).request
    processor = AutoProcessor.from_pretrained(smolvlm.hf_dir)
    ref = processor.apply_chat_template([{"role": "user", "content": [{"type": "image", "image": pil},
                                                                      {"type": "text", "text": TEXT}]}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)
    assert request.prompt_ids == ref["input_ids"][0]
    (only,) = request.images
    slot = prep.vision.slot_id if prep.vision is not None else -1
    assert only.n_tokens == 320 and len(only.spans) == 5  # 4 tiles and the overview, 64 slots each
    for start, count in only.spans:
        assert request.prompt_ids[start : start + count] == [slot] * count
        assert request.prompt_ids[start - 1] != slot and request.prompt_ids[start + count] != slot


def test_a_typed_marker_is_text_and_several_images_go_in_order(prep: LocalPreparer) -> None:
    a, b = url(picture(512, 512, 2)), url(picture(1024, 512, 3))
    request = chat(prep, [user(image(a), "an <image> typed here"), {"role": "assistant", "content": "A picture."},
                          user("and these:", image(b), image(a))]).request
    slot = prep.vision.slot_id if prep.vision is not None else -1
    first, second, third = request.images
    assert first.key == third.key != second.key  # the same picture twice: one content key
    assert [i.n_tokens for i in request.images] == [320, 192, 320]  # 2x2 + 1, 2x1 + 1 tiles
    assert request.prompt_ids.count(slot) == 320 + 192 + 320  # the typed "<image>" is text, not a slot
    starts = [s for image in request.images for s, _ in image.spans]
    assert starts == sorted(starts)


def test_low_detail_and_max_tiles_pick_the_tiles(prep: LocalPreparer) -> None:
    big = url(picture(2048, 2048, 4))
    assert [i.n_tokens for i in chat(prep, [user(image(big))]).request.images] == [5 * 64]  # the default, 4 tiles
    assert [i.n_tokens for i in chat(prep, [user(image(big, detail="low"))]).request.images] == [64]
    assert [i.n_tokens for i in chat(prep, [user(image(big))], image_max_tiles=16).request.images] == [17 * 64]
    error = refused(prep, [user(image(big))], image_max_tiles=99)
    assert (error.kind, error.field) == ("image", "image_max_tiles") and "got 99" in error.message


def b64(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


HOSTILE = [  # (the part's URL, what the refusal says)
    ("https://example.com/cat.png", "the server fetches nothing"),
    ("file:///etc/passwd", "must be a data: URL"),
    (b64(b"GIF89a" + b"\x00" * 3, "text/plain"), "data: URL of 'text/plain'"),
    ("data:image/png;base64,@@@not base64@@@", "base64 data does not decode"),
    (b64(b"this is not an image at all"), "not an image in a format webchat reads"),
    (b64(png_declaring(50_000, 50_000)), "declares more pixels than the 40000000 accepted"),
]


@pytest.mark.parametrize(("bad", "says"), HOSTILE)
def test_unreadable_images_are_refused_naming_the_part(prep: LocalPreparer, bad: str, says: str) -> None:
    error = refused(prep, [user(TEXT), {"role": "assistant", "content": "ok"}, user("look", image(bad))])
    assert (error.kind, error.field) == ("image", "messages.2.content.1")
    assert says in error.message and error.message.startswith("messages.2.content.1")


def test_a_truncated_image_is_refused(prep: LocalPreparer) -> None:
    whole = base64.b64decode(url(picture(300, 200, 5)).split(",")[1])
    error = refused(prep, [user(image(b64(whole[: len(whole) // 2])))])
    assert error.kind == "image" and "truncated" in error.message


def test_too_many_images_are_refused_before_any_is_decoded(prep: LocalPreparer) -> None:
    one = url(picture(8, 8, 6))
    error = refused(prep, [user(*[image(one)] * (MAX_IMAGES + 1))])
    assert error.field == f"messages.0.content.{MAX_IMAGES}" and f"holds {MAX_IMAGES + 1} images" in error.message


@pytest.mark.parametrize("mode", ["CMYK", "I;16", "RGBA", "P", "exif", "gif"])
def test_unusual_images_are_read_as_the_reference_reads_them(prep: LocalPreparer, mode: str) -> None:
    base = picture(64, 48, 7)
    if mode == "exif":  # rotated 90 degrees by its EXIF orientation: 48 x 64 once applied
        exif = PILImage.Exif()
        exif[0x0112] = 6
        data = url(base, "JPEG", exif=exif.tobytes())
    elif mode == "gif":  # animated: its first frame
        frames = [base.convert("P"), picture(64, 48, 8).convert("P")]
        buf = io.BytesIO()
        frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
        data = b64(buf.getvalue(), "image/gif")
    else:
        data = url(base.convert(mode), "JPEG" if mode == "CMYK" else "PNG")
    (got,) = chat(prep, [user(image(data), TEXT)]).request.images
    assert got.n_tokens == 64 * 5  # read, planned: 2 x 2 tiles and the overview


def test_the_pages_trimming_keeps_only_the_kept_images(smolvlm: Any, tokenizer: Tokenizer) -> None:
    vision = load_vision(smolvlm.mmproj_f16, 576, tokenizer)
    small = LocalPreparer(tokenizer, tokenizer.vocab_size, 600, "none", ["none"], vision)  # room for one image (320)
    old, new = url(picture(512, 512, 9)), url(picture(600, 500, 10))
    prepared = chat(small, [user(image(old), "first"), {"role": "assistant", "content": "One."},
                            user(image(new), "second")], fit=True)
    assert prepared.trimmed == 2
    (kept,) = prepared.request.images
    assert kept.key == chat(small, [user(image(new), "second")]).request.images[0].key


def test_a_template_that_shows_no_image_is_refused(smolvlm: Any, tokenizer: Tokenizer) -> None:
    text_only = Tokenizer.from_dir(tokenizer_dir(smolvlm))
    text_only.chat_template = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}{% if p['type'] == "
                               "'text' %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}")
    prep = LocalPreparer(text_only, text_only.vocab_size, 8192, "none", ["none"],
                         load_vision(smolvlm.mmproj_f16, 576, text_only))
    error = refused(prep, [user(image(url(picture(64, 64, 11))), TEXT)])
    assert error.kind == "messages" and "wrote 0 image markers" in error.message


def tokenizer_dir(fx: Any) -> Any:
    from webchat.files.gguf_cache import model_folder

    return model_folder(fx.text_gguf)


def test_a_text_only_chat_shows_its_text_on_a_template_that_reads_parts_only(tokenizer: Tokenizer) -> None:
    """SmolVLM's template iterates a content as parts: a string's characters would show nothing."""
    assert tokenizer.reads_parts_only
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hello there"}])
    assert "Hello there" in tokenizer.decode(ids)


def test_a_projector_for_another_model_is_refused(smolvlm: Any, gemma3: Any, tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="rows 640 wide; the model's embeddings are 576 wide"):
        load_vision(gemma3.mmproj_f16, 576, tokenizer)
    with pytest.raises(ValueError, match="no token '<image_soft_token>'"):
        load_vision(gemma3.mmproj_f16, 640, tokenizer)


def test_a_text_model_refuses_an_image_and_a_score_of_one_is_not_done(prep: LocalPreparer,
                                                                      tokenizer: Tokenizer) -> None:
    from webchat.serve.requests import Score

    text_model = LocalPreparer(tokenizer, tokenizer.vocab_size, 8192, "none", ["none"])
    error = refused(text_model, [user(image(url(picture(8, 8, 12))))])
    assert error.kind == "unsupported" and "reads text only" in error.message
    with pytest.raises(RequestError, match="scoring a chat that holds images is not done"):
        asyncio.run(prep.score(Score(alternatives=1, messages=[user(image(url(picture(8, 8, 12))), TEXT)])))


def test_vf_picture_is_the_tests_picture() -> None:
    """bench.vision_fidelity draws the tests' picture (its acceptance figures are on the same pixels)."""
    assert vf.picture(64, 32, 3).tobytes() == picture(64, 32, 3).tobytes()
