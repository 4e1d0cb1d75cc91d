"""`claw web`: the inspector, a login-protected web app over the same Redis: namespaces,
search (the where language), episodes with image thumbnails (LLM episodes as
transcripts), curation and recipes.

Server-rendered (Starlette + Jinja2 with autoescape, a strict Content-Security-Policy and
one small script file): step ``info`` and tags are untrusted input and are only ever
rendered as escaped text.

``app`` is the Starlette app (``auth``: logins and sessions; ``server``: running it);
``views.Inspector`` is what its pages show, built from ``access`` (per-namespace state),
``search``, ``episode`` and ``curation``; ``charts``, ``thumbs`` and ``transcript`` draw."""
