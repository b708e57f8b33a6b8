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

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
ANIMATED_SUFFIXES = (".gif", ".png", ".apng")  # frames PIL reads (load_video's GIF path)
CONTAINER_SUFFIXES = (".mp4", ".mov", ".webm", ".mkv", ".avi")  # frames ffmpeg reads
# Ours, below PIL's own decompression-bomb warning (89,478,485 pixels): 8192 x 8192.
MAX_IMAGE_PIXELS = 8192 * 8192
MAX_VIDEO_FRAMES = 1024  # as --frames


def _file_problem(option: str, path: str) -> str | None:
    if not os.path.lexists(path):
        return f"{option} {path}: no such file"
    if os.path.isdir(path):
        return f"{option} {path} is a directory; name an image file"
    if not os.path.isfile(path):
        return f"{option} {path} is not a regular file (a device, pipe or socket)"
    if not os.access(path, os.R_OK):
        return f"{option} {path} cannot be read (permission denied for this user)"
    return None


def _header(option: str, path: str, formats: tuple[str, ...]) -> tuple[tuple[str, tuple, int] | None, str | None]:
    """((format, size, frames), None) from the file's header, or (None, why it is no image)."""
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
    return found, None


def image_problems(option: str, path: str) -> list[str]:
    """Why ``path`` is no image the pipeline can be conditioned on (empty: it is)."""
    problem = _file_problem(option, path)
    if problem is None:
        problem = _header(option, path, IMAGE_FORMATS)[1]
    return [problem] if problem else []


def directory_frames(path: str) -> list[Path]:
    """A directory's frame files, in name order."""
    return sorted(p for p in Path(path).iterdir() if p.suffix.lower() in FRAME_SUFFIXES and p.is_file())


def _frame_count(option: str, path: str) -> tuple[int | None, list[str]]:
    """(how many frames the video at ``path`` holds; problems)."""
    if os.path.isdir(path):
        frames = directory_frames(path)
        problems = [p for frame in frames[: MAX_VIDEO_FRAMES + 1] for p in image_problems(option, str(frame))]
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
        return None, [f"{option} {path} cannot be read as a video: {exc}"]
    if width * height > MAX_IMAGE_PIXELS:
        return None, [
            f"{option} {path}: its frames are {width} x {height} = {width * height:,} pixels; an input image is at "
            f"most {MAX_IMAGE_PIXELS:,} pixels (8192 x 8192)"
        ]
    return count, []


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
    """The image, by diffusers' ``load_image`` (RGB)."""
    from diffusers.utils import load_image

    return load_image(str(path))


def load_conditioning_video(path: str) -> list:
    """The frames (RGB PIL images): diffusers' ``load_video`` for a GIF or a container, its
    ``load_image`` for each frame of a directory, PIL's frame iterator for an animated PNG."""
    from diffusers.utils import load_image, load_video

    if os.path.isdir(path):
        return [load_image(str(frame)) for frame in directory_frames(path)]
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
