use std::{
    marker::PhantomData,
    sync::{Arc, Mutex},
    vec,
};

use burn_communication::{CommunicationChannel, Message, Protocol, ProtocolClient};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, RwLock};

use crate::{NodeId, global::shared::GlobalCollectiveError, node::base::NodeState};

/// Handles the status of sync requests from other nodes
pub(crate) struct SyncService<P: Protocol> {
    /// Current node's state, shared with the thread that does aggregations
    node_state: Arc<RwLock<Option<NodeState>>>,
    /// The number of peers that have requested to sync with us since the last successful sync.
    syncing_peers: Mutex<Vec<NodeId>>,
    /// Notification on each incoming sync request
    sync_notif: Notify,

    _p: PhantomData<P>,
}

#[derive(Debug, Serialize, Deserialize)]
struct SyncRequest(NodeId);

impl<P: Protocol> SyncService<P> {
    pub fn new(node_state: Arc<RwLock<Option<NodeState>>>) -> Self {
        Self {
            node_state,
            syncing_peers: Mutex::new(vec![]),
            sync_notif: Notify::new(),
            _p: PhantomData,
        }
    }

    fn add_syncing_peer(&self, peer: NodeId) {
        let mut syncing_peers = self.syncing_peers.lock().unwrap();
        syncing_peers.push(peer);
    }

    /// Sync with all peers.
    ///
    /// tune's patch: a peer that cannot be reached, or closes the connection, is an error
    /// (`PeerLost`) instead of a panic of the collective server's thread.
    pub async fn sync(&self) -> Result<(), GlobalCollectiveError> {
        // we can't sync while we register
        let node_state = self.node_state.read().await;
        let node_state = node_state
            .as_ref()
            .ok_or(GlobalCollectiveError::AllReduceBeforeRegister)?;

        // this peer is syncing
        self.add_syncing_peer(node_state.node_id);
        for (id, addr) in &node_state.nodes {
            if *id == node_state.node_id {
                continue;
            }

            let Some(mut connection) = P::Client::connect(addr.clone(), "sync").await else {
                return Err(GlobalCollectiveError::PeerLost(*id));
            };
            let msg = SyncRequest(node_state.node_id);
            let sync_bytes = rmp_serde::to_vec(&msg).unwrap();
            if connection
                .send(Message::new(sync_bytes.into()))
                .await
                .is_err()
            {
                return Err(GlobalCollectiveError::PeerLost(*id));
            }
        }
        // tune's patch: upstream cleared a copy of the list (so from the second sync on the
        // list never matched and every later sync waited forever), and looked before it
        // registered for the wake-up (a request arriving in between was missed). Each node's
        // request is now consumed once per sync, so a fast peer's request for the next sync
        // is kept for it.
        let mut all_node_ids = node_state.nodes.keys().cloned().collect::<Vec<_>>();
        all_node_ids.sort();
        loop {
            let notified = self.sync_notif.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut syncing_peers = self.syncing_peers.lock().unwrap();
                if all_node_ids.iter().all(|id| syncing_peers.contains(id)) {
                    // all nodes have synced
                    for id in &all_node_ids {
                        if let Some(pos) = syncing_peers.iter().position(|p| p == id) {
                            syncing_peers.remove(pos);
                        }
                    }
                    return Ok(());
                }
            }
            // Wait for the next sync to come in
            notified.await;
        }
    }

    pub async fn handle_sync_connection<C: CommunicationChannel>(&self, mut channel: C) {
        let msg = channel.recv().await.unwrap();
        let Some(msg) = msg else {
            return;
        };

        let msg = rmp_serde::from_slice::<SyncRequest>(&msg.data).unwrap();

        self.add_syncing_peer(msg.0);

        self.sync_notif.notify_waiters();
    }
}
