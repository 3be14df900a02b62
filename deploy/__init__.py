"""Deployment artefacts (Helm chart, manifests, dashboard); the package holds their tests."""
