"""The live page's static files (index.html, app.js, style.css), served by :mod:`nat.dashboard`."""
