"""The HTTP routes, one APIRouter per concern; `openk3.api.server.create_app` includes them and owns the app-wide setup."""
