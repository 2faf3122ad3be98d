from tests.controller.conftest import ray_session

__all__ = ["ray_session"]
