"""The stateless HTTP side of Tandem: the OpenAI API and the web UI over one engine socket."""
