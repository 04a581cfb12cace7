"""The HTTP routes, one module per concern; each is an `APIRouter` that reads the app's `ServerState`
(kvserve.server.state) from the request. `kvserve.server.app.build_app` includes them all."""
