"""AUTOMATIC1111's API on the gateway (`/sdapi/v1`): what webuiapi, Open WebUI's and
SillyTavern's A1111 engines and Krita plugins send, run as kiln jobs (the same tokens, tenancy,
quotas, queue, records and events as /v1). A render call is held open until its job ends, with no
thread per waiting call (api_client.http.held); a dropped connection leaves the job running.

    fields.py   a txt2img or img2img body read onto a RenderRequest: mapped, neutral, inert, or
                refused naming the field
    answers.py  the shapes A1111's clients parse: {images, parameters, info} and the error object
    routes.py   the routes, under HTTP Basic (the token as password) or Bearer
"""

from api_client.http.a1111.answers import error, speaks
from api_client.http.a1111.routes import router

__all__ = ["error", "router", "speaks"]
