// kvserve pages: the API key. Kept in this tab's session only (sessionStorage: gone when the tab
// closes, never in a cookie or on disk), sent as `Authorization: Bearer KEY` on every API call, and
// asked for when the server answers 401 (a server started with --api-key). No dependencies.
"use strict";

const kvAuth = (() => {
  const STORE = "kvserve_api_key";
  let asking = null;  // one form at a time, whichever call met the 401 first

  const key = () => sessionStorage.getItem(STORE) || "";

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const k = key();
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  }

  function ask(message) {
    if (asking) return asking;
    asking = new Promise((resolve) => {
      const form = document.createElement("form");
      form.id = "auth-form";
      form.className = "auth";
      form.innerHTML = '<label for="auth-key"></label><input id="auth-key" type="password" ' +
        'autocomplete="off" placeholder="API key"><button id="auth-submit" type="submit">Use key</button>';
      form.querySelector("label").textContent = message;
      form.addEventListener("submit", (event) => {
        event.preventDefault();
        const value = form.querySelector("input").value.trim();
        if (!value) return;
        sessionStorage.setItem(STORE, value);
        form.remove();
        asking = null;
        resolve(value);
      });
      document.body.prepend(form);
      form.querySelector("input").focus();
    });
    return asking;
  }

  // fetch() with the key; on a 401, ask for a key (again, if the stored one was refused) and retry.
  async function fetchWithKey(url, options) {
    const opts = options || {};
    for (;;) {
      const resp = await fetch(url, Object.assign({}, opts, { headers: headers(opts.headers) }));
      if (resp.status !== 401) return resp;
      const refused = key() !== "";
      sessionStorage.removeItem(STORE);
      await ask(refused ? "The server refused this API key; enter another:"
                        : "This server needs an API key (kept in this tab only):");
    }
  }

  return { key, headers, ask, fetch: fetchWithKey };
})();
