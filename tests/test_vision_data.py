"""Rows with images: every way to give one, and every bad one stopped at start in one line naming
the row (a missing file, a corrupt image, one far over the pixel cap, a URL, more placeholders than
images)."""

from __future__ import annotations

import io
import json

import pytest

pytest.importorskip("PIL")

from nanogrpo.config import DataConfig  # noqa: E402
from nanogrpo.data import load_rows  # noqa: E402
from nanogrpo.data.images import place_images, render  # noqa: E402
from nanogrpo.data.sources import samples_from  # noqa: E402
from nanogrpo.errors import DataError  # noqa: E402
from tests.vision_fixtures import image_dataset, picture  # noqa: E402


def _write(tmp, rows) -> str:
    path = tmp / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_paths_relative_to_the_file_bytes_pil_and_hf_dicts(tmp_path):
    rows = load_rows(DataConfig(source=str(image_dataset(tmp_path, n=4))), "train")
    assert all(r["images"][0].mode == "RGB" for r in rows)
    assert rows[1]["images"][0].size == (40, 24)
    buf = io.BytesIO()
    picture(8, 12).save(buf, format="PNG")
    given = [{"question": "<image>a", "answer": "1", "images": buf.getvalue()},
             {"question": "b <image>", "answer": "2", "images": [picture(9, 9)]},
             {"question": "<image>c", "answer": "3", "images": {"bytes": buf.getvalue(), "path": None}},
             {"question": "no image", "answer": "4"}]
    out = samples_from(given, DataConfig(), "the dataset given")
    assert [len(r.get("images", [])) for r in out] == [1, 1, 1, 0]
    assert out[0]["images"][0].size == (12, 8)


@pytest.mark.parametrize("case,msg", [
    ("missing", "does not exist"), ("corrupt", "unreadable image"), ("huge", "far over"),
    ("url", "is a URL"), ("placeholders", "2 placeholder"), ("type", "must be a path")])
def test_bad_images_stop_the_run_at_start_naming_the_row(tmp_path, case, msg):
    (tmp_path / "ok.png").write_bytes(b"")
    picture(8, 8).save(tmp_path / "ok.png")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG not really")
    picture(300, 300).save(tmp_path / "huge.png")
    value = {"missing": "nope.png", "corrupt": "bad.png", "huge": "huge.png",
             "url": "https://example.com/x.png", "placeholders": "ok.png", "type": 3}[case]
    q = "<image> and <image>" if case == "placeholders" else "<image>?"
    src = _write(tmp_path, [{"question": "<image>fine", "answer": "1", "images": "ok.png"},
                            {"id": "r7", "question": q, "answer": "2", "images": [value]}])
    with pytest.raises(DataError, match=msg) as e:
        load_rows(DataConfig(source=src, max_image_pixels=32 * 32), "train")
    assert "row 1 (id 'r7')" in str(e.value) and "\n" not in str(e.value)


def test_placeholders_take_each_image_in_order():
    from nanogrpo.models.tiny_vision import make_vlm
    from nanogrpo.models.vision import image_spec

    model, tok = make_vlm("qwen2_vl")
    spec = image_spec(model, tok, None, 64, 32 * 32)
    v = render([picture(8, 8), picture(16, 16)], spec)
    text = place_images("a<image>b<image>c", "<image>", v.grid, spec)
    assert text == ("a<|vision_start|>" + "<|image_pad|>" + "<|vision_end|>b<|vision_start|>"
                    + "<|image_pad|>" * 4 + "<|vision_end|>c")
    with pytest.raises(ValueError, match="3 image placeholder"):
        place_images("<image><image><image>", "<image>", v.grid, spec)


def test_images_for_a_text_model_stop_the_run_at_start(tmp_path, capsys):
    from nanogrpo.cli import main
    from nanogrpo.models.tiny import make_model, make_tokenizer

    tok = make_tokenizer()
    make_model("tiny", tok).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    data = image_dataset(tmp_path, n=4)
    code = main(["train", "--model", str(tmp_path / "m"), "--data", str(data), "--out", str(tmp_path / "run"),
                 "--steps", "1", "rewards.workers=0", "eval.every=0"])
    err = capsys.readouterr().err
    # the first row with images named, read off the model's config.json before its weights (issue 44)
    assert code != 0 and "row 0 (id '0') has images" in err and "is a text model" in err
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.is_file() or not metrics.read_text()  # no step ran
    assert not (tmp_path / "run" / "config.yaml").is_file()  # refused in prepare, before the run started


@pytest.mark.parametrize("engine", ["vllm", "vllm_server", "fast"])
def test_images_for_an_engine_that_takes_none_stop_the_run_first(tmp_path, capsys, engine):
    """rollout.engine=vllm with an image dataset: refused for the images before vLLM's install check (a
    user who installed vLLM would only then learn that vLLM takes no images; issue 44)."""
    from nanogrpo.cli import main
    from tests.vision_fixtures import checkpoint

    data = image_dataset(tmp_path, n=4)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    for r in rows[:2]:  # the first two rows have no image
        del r["images"]
        r["question"] = r["question"].replace("<image>", "")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["train", "--model", str(checkpoint("qwen2_vl", tmp_path)), "--data", str(data), "--out",
                 str(tmp_path / "run"), "--steps", "1", "rewards.workers=0", "eval.every=0",
                 f"rollout.engine={engine}"] + (['rollout.servers=["http://127.0.0.1:9"]']
                                                if engine == "vllm_server" else []))
    err = capsys.readouterr().err
    said = f"row 2 (id '2') has images (data.image_field='images') but rollout.engine={engine}"
    assert code != 0 and said in err, err
    assert "install" not in err and "use rollout.engine=hf" in err


def test_images_with_tools_stop_the_run_at_start(tmp_path, capsys):
    from nanogrpo.cli import main
    from tests.vision_fixtures import checkpoint

    data = image_dataset(tmp_path, n=4)
    code = main(["train", "--model", str(checkpoint("qwen2_vl", tmp_path)), "--data", str(data), "--out",
                 str(tmp_path / "run"), "--steps", "1", "rewards.workers=0", "eval.every=0",
                 "tools.enabled=true"])
    err = capsys.readouterr().err
    assert code != 0 and "multi-turn rollouts (tools, environments) take no images" in err
