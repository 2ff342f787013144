"""publish: refuse unless complete, intact and validated; write the model card; upload to the Hub."""

from .api import PublishResult, publish_checkpoint
from .card import build_model_card
from .checks import Readiness, check_publishable
from .files import PublishFile, list_publish_files
from .options import PublishOptions
from .upload import HubAuthError, UploadResult, upload_to_hub

__all__ = [
    "HubAuthError",
    "PublishFile",
    "PublishOptions",
    "PublishResult",
    "Readiness",
    "UploadResult",
    "build_model_card",
    "check_publishable",
    "list_publish_files",
    "publish_checkpoint",
    "upload_to_hub",
]
