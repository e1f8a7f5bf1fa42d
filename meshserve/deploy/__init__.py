"""The Ray Serve application: OpenAI ingress → router → host actors (``app.build_app``)."""
