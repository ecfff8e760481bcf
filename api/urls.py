from django.urls import path

from api.api import api
from api.views import tokens_page

# No app namespace of its own: the API's URL names live under "api-v1" (django-ninja
# reverses its root under exactly that namespace).
urlpatterns = [
    path("v1/", api.urls),
    path("tokens/", tokens_page, name="api-tokens"),
]
