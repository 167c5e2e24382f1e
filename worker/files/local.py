"""The store in a directory on the worker's host (KILN_OUTPUT_DIR, or a path in KILN_OUTPUT_URL):
worker.files.output's files, with the names each job began kept until close_job."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from api_client.schema import ImageFile, PreviewRef, RenderResult
from worker.files import output
from worker.files.jobfiles import PREVIEW_FILE, JobFiles, RecentPreviews
from worker.files.output import EncodedImage


class LocalStore:
    """A directory on the worker's host (KILN_OUTPUT_DIR, or a path in KILN_OUTPUT_URL)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.location = str(directory)
        self._previews = RecentPreviews()
        self._files = JobFiles()

    def save_images(self, job_id: str, images: list[EncodedImage]) -> list[ImageFile]:
        """The images on disk; if one fails, none of the job's files stay."""
        for index, image in enumerate(images):
            self._files.add(job_id, output.image_name(index, image))
        try:
            files = output.save_images(self.directory, job_id, images)
        except BaseException:
            self.close_job(job_id, keep=False)
            raise
        return [f.model_copy(update={"uri": Path(f.path or "").as_uri()}) for f in files]

    def save_preview(self, job_id: str, image: Image.Image) -> str:
        self._files.add(job_id, PREVIEW_FILE)
        path = Path(output.save_preview(self.directory, job_id, image))
        uri = path.as_uri()
        self._previews.put(uri, path.read_bytes())
        return uri

    def preview_ref(self, uri: str) -> PreviewRef:
        return PreviewRef(uri=uri, data=self._previews.inline(uri))

    def write_result(self, result: RenderResult) -> None:
        """result.json, last; if it cannot be written, the job's images go too."""
        self._files.add(result.job_id, output.RESULT_FILE)
        try:
            output.write_result(self.directory, result)
        except BaseException:
            self.close_job(result.job_id, keep=False)
            raise

    def finished_result(self, job_id: str, request_digest: str) -> RenderResult | None:
        return output.finished_result(self.directory, job_id, request_digest)

    def close_job(self, job_id: str, *, keep: bool) -> None:
        names = self._files.take(job_id)
        if not keep and names:
            output.discard(self.directory, job_id, names)
