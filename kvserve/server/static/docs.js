// kvserve API reference: Swagger UI over /openapi.json, fetched with the page's API key (auth.js),
// which "Try it out" requests send too.
"use strict";

(async () => {
  const spec = await (await kvAuth.fetch("/openapi.json")).json();
  window.ui = SwaggerUIBundle({
    spec,
    dom_id: "#swagger-ui",
    deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset].filter(Boolean),
    layout: "BaseLayout",
    requestInterceptor: (req) => {
      const k = kvAuth.key();
      if (k && !req.headers.Authorization) req.headers.Authorization = "Bearer " + k;
      return req;
    },
  });
})();
