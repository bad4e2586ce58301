"""Applications above every tier: the node service (``hostcache serve``) and the end-to-end
demo (``hostcache demo``), and the ``hostcache`` console script that runs them.

They may import ``psclient``, ``hostcache`` and ``gpu``; no tier imports them
(psclient < hostcache < gpu < apps). Their heavy dependencies (matplotlib,
prometheus-client) come with the ``apps`` extra: ``pip install -e ".[apps]"``.
"""
