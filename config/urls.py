from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from config.health import health_view
from durability.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),
    path("healthz", health_view, name="health"),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/", include("api.urls")),
    path("", include("dashboard.urls")),
]
