"""The conditioning inputs of a pipeline run (``--image``, ``--video``, and a JSON line's
``"image"`` / ``"video"``): checked before anything loads, read at run time by diffusers' own
``load_image`` / ``load_video``.

The checks open only headers (PIL reads an image's size without decoding it), so a
decompression bomb is refused by its declared size before a pixel is decoded. No torch here.

A video is an mp4 (or another container ffmpeg reads: diffusers' ``load_video`` through
imageio and imageio-ffmpeg, the ``media`` extra; refused up front when either is missing), an animated GIF or PNG, or a directory of
frames (PNG, JPEG or WebP files, in name order).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.format.handles import broken_link

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
ANIMATED_SUFFIXES = (".gif", ".png", ".apng")  # frames PIL reads (load_video's GIF path)
CONTAINER_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi")  # frames ffmpeg reads
# Ours, below PIL's own decompression-bomb warning (89,478,485 pixels): 8192 x 8192.
MAX_IMAGE_PIXELS = 8192 * 8192
MAX_VIDEO_FRAMES = 1024  # as --frames
# An image is decoded whole before the load up to this size (4096 x 4096: about a tenth of a second,
# 64 MiB); a larger one is verified by PIL only.
MAX_DECODED_PIXELS = 4096 * 4096
CONDITIONING = "conditioning input"  # the context of a run-time failure to read one


def _file_problem(option: str, path: str) -> str | None:
    if not os.path.lexists(path):
        return f"{option} {path}: no such file"
    if link := broken_link(path):
        return f"{option} {path} is {link}"
    if os.path.isdir(path):
        return f"{option} {path} is a directory; name an image file"
    if not os.path.isfile(path):
        return f"{option} {path} is not a regular file (a device, pipe or socket)"
    if not os.access(path, os.R_OK):
        return f"{option} {path} cannot be read (permission denied for this user)"
    return None


def _header(
    option: str, path: str, formats: tuple[str, ...], decode_limit: int | None = None
) -> tuple[tuple[str, tuple, int] | None, str | None]:
    """((format, size, frames), None) from the file's header, or (None, why it is no image);
    ``decode_limit``: the image is verified too, and decoded whole up to that many pixels
    (``_decode_problem``), once its size is known to be in bounds (None: its header only)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused below, by our bound
            with Image.open(path) as image:
                found = image.format, image.size, getattr(image, "n_frames", 1)
    except Image.DecompressionBombError as exc:
        return None, f"{option} {path}: {exc}; an input image is at most {MAX_IMAGE_PIXELS:,} pixels"
    except UnidentifiedImageError:
        return None, f"{option} {path} is not an image ({', '.join(formats)})"
    except OSError as exc:
        return None, f"{option} {path} cannot be read: {exc.strerror or exc}"
    if found[0] not in formats:
        return None, f"{option} {path} is a {found[0]} image; it takes {', '.join(formats)}"
    (width, height) = found[1]
    if width * height > MAX_IMAGE_PIXELS:
        return None, (
            f"{option} {path} is {width} x {height} = {width * height:,} pixels; an input image is at most "
            f"{MAX_IMAGE_PIXELS:,} pixels (8192 x 8192)"
        )
    if decode_limit is not None and (problem := _decode_problem(option, path, width * height <= decode_limit)):
        return None, problem
    return found, None


def _decode_problem(option: str, path: str, whole: bool) -> str | None:
    """Why the image at ``path`` (its header read) cannot be decoded: PIL's ``verify()`` (a PNG's
    chunks and their CRCs, to its end), then (``whole``) the decode ``load_image`` will make after
    the load (a truncated JPEG or PNG: "image file is truncated")."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                image.verify()
            if whole:
                with Image.open(path) as image:
                    image.load()
    except Exception as exc:  # noqa: BLE001 - PIL's words on a file it cannot decode (OSError, SyntaxError, ...)
        return f"{option} {path} cannot be decoded (truncated or corrupt): {first_line(exc)}"
    return None


def first_line(exc: BaseException) -> str:
    """An exception's first line: another library's diagnostics after it never reach the user."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def image_problems(option: str, path: str) -> list[str]:
    """Why ``path`` is no image the pipeline can be conditioned on (empty: it is): its file, its
    header, its bytes verified, and its pixels decoded up to ``MAX_DECODED_PIXELS``."""
    problem = _file_problem(option, path) or _header(option, path, IMAGE_FORMATS, MAX_DECODED_PIXELS)[1]
    return [problem] if problem else []


def _frames_problems(option: str, frames: list[Path]) -> list[str]:
    """A directory's frames as images, each verified, decoded whole while their pixels add up to at
    most ``MAX_DECODED_PIXELS`` x 4 (about 70 frames of 720p, a second or so; a long clip of large
    frames is not decoded twice over before the load)."""
    problems, budget = [], 4 * MAX_DECODED_PIXELS
    for frame in frames:
        found, problem = None, _file_problem(option, str(frame))
        if problem is None:
            found, problem = _header(option, str(frame), IMAGE_FORMATS, budget)
        if found is not None:
            budget = max(0, budget - found[1][0] * found[1][1])
        problems += [problem] if problem else []
    return problems


def directory_frames(path: str) -> list[Path]:
    """A directory's frame files, in name order."""
    return sorted(p for p in Path(path).iterdir() if p.suffix.lower() in FRAME_SUFFIXES and p.is_file())


def _frame_count(option: str, path: str) -> tuple[int | None, list[str]]:
    """(how many frames the video at ``path`` holds; problems)."""
    if os.path.isdir(path):
        frames = directory_frames(path)
        problems = _frames_problems(option, frames[: MAX_VIDEO_FRAMES + 1])
        return len(frames), problems
    problem = _file_problem(option, path)
    if problem:
        return None, [problem]
    suffix = Path(path).suffix.lower()
    if suffix in ANIMATED_SUFFIXES:
        found, problem = _header(option, path, ("GIF", "PNG"))
        return (found[2], []) if found else (None, [problem])
    if suffix not in CONTAINER_SUFFIXES:
        return None, [f"{option} {path}: give an mp4, an animated GIF or PNG, or a directory of frames"]
    return _container_frame_count(option, path, suffix)


def _container_frame_count(option: str, path: str, suffix: str) -> tuple[int | None, list[str]]:
    """An mp4's (or another container's) frame count, by the reader diffusers' ``load_video``
    uses: ``imageio.get_reader``, after ``imageio.plugins.ffmpeg.get_exe()``, which needs
    imageio-ffmpeg (its ffmpeg binary). Both are checked here, where a missing one is a refusal
    before the load; in ``load_video`` it would be an error after it."""
    try:
        import imageio
        import imageio_ffmpeg  # noqa: F401 - load_video's get_exe() needs it
    except ImportError:
        return None, [
            f"{option} {path}: reading {suffix} needs imageio and imageio-ffmpeg (diffusers' load_video; "
            "pip install 'fsdp-fp8[media]', or pip install imageio imageio-ffmpeg); or give a directory of "
            "frames or an animated PNG"
        ]
    try:
        with imageio.get_reader(path) as reader:
            width, height = reader.get_meta_data().get("size") or (0, 0)
            count = reader.count_frames()
    except Exception as exc:  # noqa: BLE001 - ffmpeg's own words on a file it cannot read
        return None, [f"{option} {path} cannot be read as a video: {_ffmpeg_reason(exc)}"]
    if width * height > MAX_IMAGE_PIXELS:
        return None, [
            f"{option} {path}: its frames are {width} x {height} = {width * height:,} pixels; an input image is at "
            f"most {MAX_IMAGE_PIXELS:,} pixels (8192 x 8192)"
        ]
    return count, []


def _ffmpeg_reason(exc: BaseException) -> str:
    """imageio's error in one line: its first line, and ffmpeg's last line (its verdict) where it
    appends ffmpeg's output (the version banner and build configuration: never shown)."""
    text = str(exc)
    reason = first_line(exc)
    _, marker, stderr = text.partition("=== stderr ===")
    verdict = [line.strip() for line in stderr.splitlines() if line.strip()] if marker else []
    return f"{reason} (ffmpeg: {verdict[-1]})" if verdict else reason


def video_problems(option: str, path: str) -> list[str]:
    """Why ``path`` is no video the pipeline can be conditioned on: unreadable, no frames, or more
    than ``MAX_VIDEO_FRAMES`` (empty: it is)."""
    if not os.path.lexists(path):
        return [f"{option} {path}: no such file or directory"]
    count, problems = _frame_count(option, path)
    if count == 0:
        problems.append(f"{option} {path} has no frames")
    elif count is not None and count > MAX_VIDEO_FRAMES:
        problems.append(f"{option} {path} has {count:,} frames; a conditioning video is at most {MAX_VIDEO_FRAMES:,}")
    return problems


def load_conditioning_image(path: str):
    """The image, by diffusers' ``load_image`` (RGB); a failure is an ``ArgumentError`` naming the
    file (one changed since its check, or larger than the check decodes)."""
    from diffusers.utils import load_image

    try:
        return load_image(str(path))
    except Exception as exc:
        raise ArgumentError(f"image {path} cannot be read: {first_line(exc)}", CONDITIONING) from None


def load_conditioning_video(path: str) -> list:
    """The frames (RGB PIL images), as ``_read_video`` reads them; a failure is an ``ArgumentError``
    naming the file."""
    try:
        return _read_video(path)
    except ArgumentError:
        raise
    except Exception as exc:
        raise ArgumentError(f"video {path} cannot be read: {_ffmpeg_reason(exc)}", CONDITIONING) from None


def _read_video(path: str) -> list:
    """diffusers' ``load_video`` for a GIF or a container, its ``load_image`` for each frame of a
    directory, PIL's frame iterator for an animated PNG."""
    from diffusers.utils import load_video

    if os.path.isdir(path):
        return [load_conditioning_image(str(frame)) for frame in directory_frames(path)]
    if Path(path).suffix.lower() in (".png", ".apng"):  # load_video reads GIF frames with PIL; APNG alike
        from PIL import Image, ImageSequence

        with Image.open(path) as image:
            return [frame.convert("RGB") for frame in ImageSequence.Iterator(image)]
    return load_video(str(path))


__all__ = [
    "MAX_IMAGE_PIXELS",
    "MAX_VIDEO_FRAMES",
    "image_problems",
    "load_conditioning_image",
    "load_conditioning_video",
    "video_problems",
]
